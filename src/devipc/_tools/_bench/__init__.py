"""The benchmarks behind `devipc bench` (and benchmarks/*.py, which add the checks and the doc
updates of docs/benchmarks.md): `ipc` (round-trip latency through a Queue), `p2p` (one-sided
bandwidth), `weight_sync` (a state_dict synced five ways). Each `measure` returns plain rows;
`common` prints and plots them. Torch and the standard library only; tqdm and matplotlib are
loaded by name when present (`devipc[bench]`, `devipc[plot]`)."""

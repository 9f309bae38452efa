"""The `devipc` command and what it runs: `doctor` (`_doctor`), `info`, `bench` (`_bench`, whose
measuring code the scripts in `benchmarks/` reuse) and the helpers they share (`_common`: which
devices registered hooks, optional packages loaded by name).

The top layer, a user of the others: it may import the sharing core (`_core`), weight sync
(`_weights`), `p2p`, the public package (`devipc`, `hooks`); nothing but `devipc.__main__` and
the command's entry point imports it.
"""

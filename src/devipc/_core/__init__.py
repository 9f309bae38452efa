"""The sharing core: what moves a tensor between processes without a copy, for any device.

It owns the device contract (`_hooks`, the facts of `_devices`), device memory and its
ref-counter slots (`_memory`, `_refcount`, `_memfd`, `_locks`, `_futex`, `_lifeline`), what a
producer sent and a consumer holds (`_exports`, `_received`, `_sharing`, `_background`), torch's
pickling plumbing (`_reductions`), the wire format (`_wire`), typed handles and their tables
(`_handles`, `_table`, `_state_dict`, `_copies`, `_host`) and the stats page (`_statspage`).

It imports torch and the standard library only, never another layer of devipc (`p2p`,
`_weights`, `_tools`, `ray`, `vllm`, `conformance`); everything else is built on it.
"""

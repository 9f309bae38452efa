"""Weight sync: a trainer publishes generations of its weights, engines pull them.

It owns the publisher and subscriber (`_publisher`, a façade over a backend: one host in
`_publisher_local`, across hosts over NIXL in `_remote_publisher` and `_remote_subscriber`, whose
token and control block are laid out in `_remote_token`), the relay chain of a fleet (`_relay`),
sharded trainers and engines that pull slices (`_shard_layout`, `_sharded`), the reusable arena
(`_arena`), the records of readers (`_readers`), checksums (`_checksum`) and what both publishers
share (`_common`: named weights, packing, the copy=False check, the token's kind).

It may import the sharing core (`_core`) and `p2p`, never `_tools`, `ray`, `vllm` or
`conformance`, which are built on it.
"""

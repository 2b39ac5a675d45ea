"""Data parallelism on one node or many: launch helpers, the all-reduce benchmark and DDP wrappers.

Import the submodules directly (``systems.distributed.launch``, ``.ddp``, ``.allreduce_bench``,
``.ddp_bench``); this package imports nothing itself so that importing it has no side effects.
"""

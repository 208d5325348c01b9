"""retained: the model state that outlives the trainer (docs/design.md 2.1).

The store (``store.RetainedStore``: segments in POSIX shared memory, or CUDA device memory
through ``backends``), where every byte lives (``layout``), which pages each parity page covers
(``groups``: the tier plans), the checksummed spec and metadata (``spec``, ``integrity``) and the
progress record (``record.ProgressEntry``). Imports only ``protection``, ``errors`` and the
leaves; the updater above it writes it. What a program uses is in ``leto_lightning.__all__``.
"""

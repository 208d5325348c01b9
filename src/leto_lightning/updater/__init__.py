"""updater: optimizer updates over retained memory and recovery from a crash (docs/design.md 2.3).

Chunk transactions (``transaction``) and whole-state ones (``whole_state``) for any
``torch.optim`` optimizer bound by ``retained_optimizer.RetainedOptimizer``; page repair from
parity (``repair``) and the recovery of a node's stores (``recovery.recover_node``). The only
writer of the progress record. Imports ``retained``, ``protection``, ``errors`` and the leaves.
What a program uses is in ``leto_lightning.__all__``.
"""

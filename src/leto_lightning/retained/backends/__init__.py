"""Where retained segments live besides POSIX shared memory (``retained.shm``).

``cuda_ipc``: device memory owned by a state-manager process, opened by trainers through CUDA
IPC handles (``RetainedConfig(backend="cuda")``; see docs/cuda-backend.md).
"""

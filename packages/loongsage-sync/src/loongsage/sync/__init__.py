"""GPU weight transports: CUDA IPC (``ipc``) and a broadcast over a private group (``broadcast``)."""

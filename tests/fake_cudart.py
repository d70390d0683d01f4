"""A stand-in for `torch.cuda.cudart()` on a machine without CUDA, as the offload's exact pinning
(`trainer.model.long_rows.pinned_exact`) calls it: it records what is registered and unregistered,
and refuses to register on demand (as a driver out of lockable memory would)."""

from __future__ import annotations


class FakeCudart:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.registered: list[tuple[int, int]] = []  # (address, bytes)
        self.unregistered: list[int] = []  # addresses

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        if self.refuse:
            return 1  # cudaErrorInvalidValue
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0

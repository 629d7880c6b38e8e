"""Why a kernel under test did not compare a case: shared by every kernel loader (kernels.py,
attention.py) and the engines that offer their own kernels as subjects (engines/vllm_kernels.py)."""


class Unsupported(NotImplementedError):
    """A kernel does not handle this type or shape (the case is skipped with this reason)."""


class KernelUnavailable(Exception):
    """A kernel exists but cannot run here (missing library, wrong device): skipped with the reason."""

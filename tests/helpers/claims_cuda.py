"""A host array that claims to live on CUDA device 0, for testing what the core does with
CUDA arrays on a machine without a device: it must refuse them before any device access."""

import ctypes

ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
DL_CUDA = 2


class ClaimsCuda:
    """Wraps a NumPy array; its DLPack capsule says CUDA device 0."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return (DL_CUDA, 0)

    def __dlpack__(self, **kwargs):
        capsule = self.array.__dlpack__()
        tensor = ctypes.pythonapi.PyCapsule_GetPointer(capsule, b"dltensor")
        ctypes.c_int32.from_address(tensor + 8).value = DL_CUDA  # DLTensor.device.device_type
        return capsule

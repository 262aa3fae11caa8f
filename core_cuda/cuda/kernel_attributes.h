// CUTLASS's device-level initialize() sets its kernel's shared-memory limit
// (cudaFuncSetAttribute) on every call. The attribute belongs to the kernel on a device
// and only needs setting once there; after that a call takes update(), which builds the
// same kernel parameters without it. One instance per kernel instantiation (a function-
// local static), one flag per device.
#pragma once

#include <atomic>

namespace groupgemm {
namespace cuda {

class KernelAttributesOnce {
 public:
  // True until done() was called for `device` (and for devices past the table: always).
  bool needed(int device) const {
    return device < 0 || device >= kMaxDevices || !set_[device].load(std::memory_order_acquire);
  }
  void done(int device) {
    if (device >= 0 && device < kMaxDevices) set_[device].store(true, std::memory_order_release);
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::atomic<bool> set_[kMaxDevices] = {};
};

}  // namespace cuda
}  // namespace groupgemm

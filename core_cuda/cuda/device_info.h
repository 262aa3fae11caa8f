// Per-device facts every CUDA call needs (compute capability, SM count), queried once per
// device and process instead of on every call: a call's host time is part of what a small
// MoE layer waits for.
#pragma once

#include "groupgemm/types.h"

namespace groupgemm {
namespace cuda {

struct DeviceInfo {
  int device;
  int cc_major, cc_minor;
  int sm_count;
};

// `device`'s facts (cached after the first successful query).
Status device_info(int device, DeviceInfo* info);

// The current device's facts.
Status current_device_info(DeviceInfo* info);

// Whether this process has a usable CUDA device (cached once it does; without a driver or
// a device, the error says so on every call).
Status check_device();

}  // namespace cuda
}  // namespace groupgemm

// The per-device cache of device_info.h. Each entry is written once, by the thread that
// claims it, and read without a lock once published; a thread that finds it being
// written queries the device itself.
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "device_info.h"

namespace groupgemm {
namespace cuda {
namespace {

constexpr int kMaxDevices = 64;

enum : int { kEmpty = 0, kWriting = 1, kReady = 2 };

struct CachedInfo {
  std::atomic<int> state{kEmpty};
  DeviceInfo info{};
};

CachedInfo g_devices[kMaxDevices];
std::atomic<bool> g_have_device{false};

Status query(int device, DeviceInfo* info) {
  info->device = device;
  if (cudaDeviceGetAttribute(&info->cc_major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&info->cc_minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return Status::Internal("cannot query the CUDA device");
  }
  return Status::Ok();
}

}  // namespace

Status device_info(int device, DeviceInfo* info) {
  if (device < 0 || device >= kMaxDevices) return query(device, info);
  CachedInfo& cached = g_devices[device];
  if (cached.state.load(std::memory_order_acquire) == kReady) {
    *info = cached.info;
    return Status::Ok();
  }
  GG_RETURN_IF_ERROR(query(device, info));
  int empty = kEmpty;
  if (cached.state.compare_exchange_strong(empty, kWriting, std::memory_order_acquire)) {
    cached.info = *info;
    cached.state.store(kReady, std::memory_order_release);
  }
  return Status::Ok();
}

Status current_device_info(DeviceInfo* info) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return Status::Internal("cannot query the CUDA device");
  }
  return device_info(device, info);
}

Status check_device() {
  if (g_have_device.load(std::memory_order_relaxed)) return Status::Ok();
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaSuccess && count > 0) {
    g_have_device.store(true, std::memory_order_relaxed);
    return Status::Ok();
  }
  cudaGetLastError();  // clear the sticky error so later calls are not affected
  return Status::Internal(std::string("no usable CUDA device (") +
                          (e == cudaSuccess ? "none found" : cudaGetErrorString(e)) + ")");
}

}  // namespace cuda
}  // namespace groupgemm

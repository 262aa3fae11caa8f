// What every CUDA entry point checks before it launches (a usable device: device_info.h's
// check_device; no earlier error pending), and the guard that makes the operands' device
// current for its launches.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "device_info.h"
#include "groupgemm/types.h"

namespace groupgemm {
namespace cuda {

// The process's record of its CUDA calls and of those that ran while their stream was
// capturing (a CUDA graph or an XLA command buffer being recorded): what a capture check
// needs as evidence (see CaptureRecord). One definition across translation units.
inline std::atomic<int64_t> g_calls{0}, g_calls_under_capture{0};
inline std::atomic<int> g_first_under_capture{-1};  // -1: no call yet

inline void record_call(bool under_capture) {
  int none = -1;
  g_first_under_capture.compare_exchange_strong(none, under_capture ? 1 : 0);
  g_calls.fetch_add(1);
  if (under_capture) g_calls_under_capture.fetch_add(1);
}

// Makes the operands' device current for the call and restores the caller's afterwards.
// torch names the tensors' device; XLA passes a stream of the buffers' device.
class DeviceGuard {
 public:
  explicit DeviceGuard(const ExecContext& ctx) {
    const auto stream = static_cast<cudaStream_t>(ctx.stream);
    int device = ctx.device_index;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (stream) {
      if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
        cudaGetLastError();
        status_ = Status::Internal("cannot query the capture status of the stream");
        return;
      }
      record_call(capture != cudaStreamCaptureStatusNone);
    }
    if (device < 0 && stream) {
      // While XLA traces a command buffer, its stream is capturing and the runtime refuses
      // cudaStreamGetDevice (cudaErrorStreamCaptureUnsupported, left pending for the next
      // caller). A capture records work for the current device, which XLA has made the
      // stream's, so there is nothing to switch.
      if (capture != cudaStreamCaptureStatusNone) return;
      if (cudaStreamGetDevice(stream, &device) != cudaSuccess) {
        cudaGetLastError();  // reported here, not left pending for the next call
        status_ = Status::Internal("cannot find the CUDA device of the stream");
        return;
      }
    }
    if (device < 0 || cudaGetDevice(&previous_) != cudaSuccess || previous_ == device) return;
    if (cudaSetDevice(device) != cudaSuccess) {
      status_ = Status::Internal("cannot select the operands' CUDA device");
      return;
    }
    switched_ = true;
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  const Status& status() const { return status_; }

 private:
  Status status_;
  int previous_ = -1;
  bool switched_ = false;
};

// An error left pending by someone else's earlier launch would otherwise be reported
// (and cleared) as ours.
inline Status check_no_pending_error() {
  const cudaError_t e = cudaPeekAtLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("an earlier CUDA error is pending: ") + cudaGetErrorString(e));
}

}  // namespace cuda
}  // namespace groupgemm

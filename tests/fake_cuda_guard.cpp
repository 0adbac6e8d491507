// Test harness only (tests/fake_gpu.py): lets a CPU-only PyTorch build run autograd on FakeTensorMode
// tensors whose device is "cuda". It registers c10's FakeGuardImpl as the CUDA device guard (autograd
// records a stream per device) and CUDA hooks under the registry key "CUDAHooks" that say CUDA is built
// (the autograd engine asks for the accelerator) and has no primary context (no stream syncs to do).
// No kernel runs on "cuda": every operation on such tensors is FakeTensorMode's shape propagation.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

namespace at {
namespace {
struct CUDAHooks : public CUDAHooksInterface {
  explicit CUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return false; }
};
}  // namespace
REGISTER_CUDA_HOOKS(CUDAHooks);
}  // namespace at

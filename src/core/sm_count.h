// The current device's multiprocessor count, for host code that sizes grids by it. A plain header
// (no tensor or fmt includes), so that the .cu launchers can include it too; defined in device.cpp.
#pragma once

namespace fourbit {

// Cached per device and thread: cheap enough for every kernel launch (current_device_properties()
// is not). CUDA builds only.
int current_device_sm_count();

}  // namespace fourbit

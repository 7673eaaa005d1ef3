// Compile-time checks of the format descriptors (the codecs themselves are header-only so that
// g++ and nvcc compile the same code).
#include "formats/element.h"
#include "formats/scale_layout.h"

namespace fourbit::formats {

static_assert(kE2M1.max_code == 0x7 && kE4M3.max_code == 0x7E && kE5M2.max_code == 0x7B);
static_assert(kE4M3.emin == 1 - kE4M3.bias && kE5M2.emin == 1 - kE5M2.bias &&
              kE2M1.emin == 1 - kE2M1.bias);

}  // namespace fourbit::formats

// The error message a failed entry point left for Python (runtime.h's `guarded`), per thread.
#include "runtime.h"

namespace conveyor {

std::string& last_error() {
    static thread_local std::string message;
    return message;
}

}  // namespace conveyor

CONVEYOR_API const char* conveyor_last_error() { return conveyor::last_error().c_str(); }

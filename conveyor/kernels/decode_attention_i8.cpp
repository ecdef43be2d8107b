// `attend_request` for an int8 KV cache, compiled in a source of its own (attention_cpu.h).
#include "attention_cpu.h"

namespace conveyor {

template void attend_request<int8_t>(const float* q, const int8_t* kc, const int8_t* vc, const int64_t* table, int64_t len,
                                   int64_t first, int64_t ring, int64_t page, int64_t Hkv, int64_t D, int64_t G,
                                   int64_t h0, int64_t h1, float scale, float cap, const float* sinks,
                                   DecodeScratch& sc, float* out);

}  // namespace conveyor

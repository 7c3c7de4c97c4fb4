// FlashMLA's Hopper decode kernels (github.com/deepseek-ai/FlashMLA) timed at the shapes of
// benchmarks/kernels.py: the ground truth beside jaxspec's MLA kernels. benchmarks/flashmla.py
// builds this file against a FlashMLA checkout and runs it; it is not part of jaxspec.
//
// Why a harness of its own instead of FlashMLA's Python package: the package is a PyTorch
// extension, which must be built against the lent GPU machine's own PyTorch and takes most of
// its sources' compile time there. This file calls the same host entry points the package's
// API calls (csrc/api/dense_decode.h, sparse_decode.h: scheduler metadata, the split-KV kernel,
// the combine kernel), with buffers from cudaMalloc, so it needs only nvcc and FlashMLA's
// headers, and links four of its translation units.
//
//   flashmla_bench dense  BATCH CONTEXT QUERIES ITERS        bf16 latent cache [pages, 64, 576]
//   flashmla_bench sparse BATCH CONTEXT QUERIES ITERS TOPK   V3.2's FP8 cache (656 bytes a slot)
//   flashmla_bench v4     BATCH CONTEXT QUERIES ITERS RATE TOPK   DeepSeek-V4-Flash (MODEL1 FP8 pools)
//   flashmla_bench copy   MIB                                device-to-device copy, the bandwidth baseline
//
// prints one JSON object: the median and best time of ITERS calls (split-KV kernel + combine,
// each call timed by CUDA events; the scheduler metadata, which a decode step computes once for
// all its layers, is timed apart), the bytes and flops as kernels.py counts them (cache reads,
// sparse indices, queries, outputs; every score of the window, masked or not), and the largest error of a few output rows against a
// float64 reference computed here from the same data.
//
// Data: 128 query heads, latent 512 + RoPE 64, pages of 64 slots in a random order, every row
// at CONTEXT tokens. Dense: a window of QUERIES > 1 tokens is causal (token i sees the first
// CONTEXT - QUERIES + i + 1 slots), as a chain verification window is. Sparse: each query token
// selects TOPK distinct random slots among those it sees (indices into the page pool). V4: 64
// heads of 512 (448 + 64 RoPE; K = V), FlashMLA's MODEL1 FP8 token, per-head attention sinks;
// each query token attends to its 128-token sliding window (FlashMLA's extra cache: a ring of
// 192 slots a row) and to TOPK of the entries closed every RATE tokens it sees (CSA: RATE 4, TOPK
// 512 of them at random; HCA: RATE 128, every one, the list padded with -1 to TOPK).

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {

constexpr int kHeads = 128, kDim = 576, kLatent = 512, kPage = 64;
constexpr int kFp8Slot = kLatent + 4 * 4 + 64 * 2;  // e4m3 latent, 4 float32 tile scales, bf16 RoPE
constexpr float kScale = 0.0722f;                    // about DeepSeek-V3's softmax scale

#define CHECK(call)                                                                          \
    do {                                                                                     \
        cudaError_t status_ = (call);                                                              \
        if (status_ != cudaSuccess) {                                                            \
            fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(status_), __FILE__, __LINE__); \
            exit(2);                                                                         \
        }                                                                                    \
    } while (0)

__device__ __host__ inline uint32_t mix(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return static_cast<uint32_t>(x);
}

// Element i of a stream: uniform in [-1, 1), a function of (seed, i) so the host reference can
// recompute any element without copying the device's buffers back.
__device__ __host__ inline float uniform(uint64_t seed, uint64_t i) {
    return (mix(seed * 0x9e3779b97f4a7c15ULL + i) >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void fill_bf16(cutlass::bfloat16_t* out, uint64_t n, uint64_t seed) {
    for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
        out[i] = cutlass::bfloat16_t(uniform(seed, i));
}

// An e4m3 byte of stream element i: finite (0x7f and 0xff are NaN in e4m3fn).
__device__ __host__ inline uint8_t fp8_byte(uint64_t seed, uint64_t i) {
    uint8_t b = mix(seed * 0x9e3779b97f4a7c15ULL + i) & 0xff;
    return (b & 0x7f) == 0x7f ? b - 1 : b;
}

__device__ __host__ inline float fp8_value(uint8_t b) {
    int sign = b >> 7, exponent = (b >> 3) & 15, mantissa = b & 7;
    float magnitude = exponent == 0 ? ldexpf(mantissa / 8.0f, -6) : ldexpf(1.0f + mantissa / 8.0f, exponent - 7);
    return sign ? -magnitude : magnitude;
}

// Slot s of the FP8 pool: its latent bytes, its four tile scales (powers of two, 2^-8 .. 2^-5:
// the quantized latent then spans about what the bf16 one does) and its RoPE part.
__device__ __host__ inline float fp8_scale(uint64_t seed, uint64_t slot, int tile) {
    return ldexpf(1.0f, -5 - int(mix(seed + 7 * slot + tile) & 3));
}

__global__ void fill_fp8_pool(uint8_t* pool, uint64_t slots, uint64_t seed) {
    for (uint64_t s = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; s < slots; s += uint64_t(gridDim.x) * blockDim.x) {
        uint8_t* slot = pool + s * kFp8Slot;
        for (int j = 0; j < kLatent; ++j) slot[j] = fp8_byte(seed, s * kLatent + j);
        float* scales = reinterpret_cast<float*>(slot + kLatent);
        for (int t = 0; t < 4; ++t) scales[t] = fp8_scale(seed, s, t);
        cutlass::bfloat16_t* rope = reinterpret_cast<cutlass::bfloat16_t*>(slot + kLatent + 16);
        for (int j = 0; j < 64; ++j) rope[j] = cutlass::bfloat16_t(uniform(seed + 1, s * 64 + j));
    }
}

// Stream values as bf16 rounds them (the host reference reads what the device holds).
inline float bf16_of(uint64_t seed, uint64_t i) { return float(cutlass::bfloat16_t(uniform(seed, i))); }

struct Timing { double median_us, best_us, metadata_us; };

template <typename Call>
Timing time_calls(Call call, int iters, double metadata_us) {
    for (int i = 0; i < 5; ++i) call();
    std::vector<cudaEvent_t> events(iters + 1);
    for (auto& e : events) CHECK(cudaEventCreate(&e));
    CHECK(cudaEventRecord(events[0]));
    for (int i = 0; i < iters; ++i) { call(); CHECK(cudaEventRecord(events[i + 1])); }
    CHECK(cudaEventSynchronize(events[iters]));
    CHECK(cudaGetLastError());
    std::vector<double> us(iters);
    for (int i = 0; i < iters; ++i) {
        float ms;
        CHECK(cudaEventElapsedTime(&ms, events[i], events[i + 1]));
        us[i] = ms * 1e3;
    }
    for (auto& e : events) CHECK(cudaEventDestroy(e));
    std::sort(us.begin(), us.end());
    return {us[iters / 2], us[0], metadata_us};
}

// One call's time, after one untimed call (a kernel's first launch loads its module).
template <typename Call>
double time_once(Call call) {
    call();
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
    CHECK(cudaEventRecord(a)); call(); CHECK(cudaEventRecord(b)); CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e3;
}

// Softmax attention of one query row over the given keys, in float64: (q . key x scale -> weights)
// x the keys' first `values` entries; a finite `sink` is a logit in the denominator only (V4's,
// as FlashMLA takes it).
std::vector<double> attend(const std::vector<double>& q, const std::vector<std::vector<double>>& keys, double scale,
                           int values, double sink = -INFINITY) {
    std::vector<double> scores(keys.size());
    double top = sink;
    for (size_t k = 0; k < keys.size(); ++k) {
        scores[k] = scale * std::inner_product(q.begin(), q.end(), keys[k].begin(), 0.0);
        top = std::max(top, scores[k]);
    }
    std::vector<double> out(values, 0.0);
    double total = std::isfinite(sink) ? std::exp(sink - top) : 0.0;
    for (size_t k = 0; k < keys.size(); ++k) {
        const double w = std::exp(scores[k] - top);
        total += w;
        for (int j = 0; j < values; ++j) out[j] += w * keys[k][j];
    }
    for (auto& v : out) v /= total;
    return out;
}

void print_json(const char* op, int batch, int context, int queries, int heads, int topk, const Timing& t, double bytes,
                double flops, double max_err, int num_sm_parts) {
    printf("{\"op\": \"%s\", \"impl\": \"flashmla\", \"batch\": %d, \"context\": %d, \"queries\": %d, "
           "\"heads\": %d, \"topk\": %d, \"median_us\": %.3f, \"best_us\": %.3f, \"metadata_us\": %.3f, "
           "\"bytes\": %.0f, \"flops\": %.0f, \"max_abs_err\": %.3g, \"num_sm_parts\": %d}\n",
           op, batch, context, queries, heads, topk, t.median_us, t.best_us, t.metadata_us, bytes, flops, max_err,
           num_sm_parts);
}

int num_sms() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major != 9) {
        fprintf(stderr, "FlashMLA's sm90 kernels need a Hopper GPU, found compute capability %d.%d\n", prop.major, prop.minor);
        exit(2);
    }
    return prop.multiProcessorCount;
}

// A device array of n T, and a device copy of a host vector.
template <typename T>
T* device_array(size_t n) {
    T* device;
    CHECK(cudaMalloc(&device, n * sizeof(T)));
    return device;
}

template <typename T>
T* to_device(const std::vector<T>& host) {
    T* device = device_array<T>(host.size());
    CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return device;
}

// Rows [b, s, h] the reference checks: first, last and one in between.
std::vector<std::array<int, 3>> checked_rows(int batch, int queries, int heads) {
    return {{0, 0, 0}, {batch - 1, queries - 1, heads - 1}, {batch / 2, queries / 2, heads / 2 + 13}};
}

void run_dense(int batch, int context, int queries, int iters) {
    const int sms = num_sms();
    const int pages = (context + kPage - 1) / kPage, num_blocks = batch * pages;
    const int rows = queries * kHeads;  // q_seq_per_hk: one KV head
    const int num_sm_parts = std::max(sms / ((rows + 63) / 64), 1);
    const bool causal = queries > 1;
    const uint64_t q_seed = 1, k_seed = 2;

    std::vector<int> table(num_blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(3));
    std::vector<int> lengths(batch, context);

    const size_t q_size = size_t(batch) * rows * kDim, cache_size = size_t(num_blocks) * kPage * kDim;
    const int total_splits = batch + num_sm_parts;
    auto* q = device_array<cutlass::bfloat16_t>(q_size);
    auto* cache = device_array<cutlass::bfloat16_t>(cache_size);
    auto* out = device_array<cutlass::bfloat16_t>(size_t(batch) * rows * kLatent);
    auto* lse = device_array<float>(size_t(batch) * rows);
    auto* lse_accum = device_array<float>(size_t(total_splits) * rows);
    auto* out_accum = device_array<float>(size_t(total_splits) * rows * kLatent);
    int* d_table = to_device(table);
    int* d_lengths = to_device(lengths);
    int* num_splits = device_array<int>(batch + 1);
    auto* meta = device_array<DecodingSchedMeta>(num_sm_parts);
    fill_bf16<<<1024, 256>>>(q, q_size, q_seed);
    fill_bf16<<<1024, 256>>>(cache, cache_size, k_seed);

    GetDecodeSchedMetaParams meta_params = {batch, queries, 64, 5, -1, -1, nullptr, nullptr, d_lengths, meta,
                                            num_splits, num_sm_parts, nullptr};
    double metadata_us = time_once([&] { smxx::decode::run_get_decoding_sched_meta_kernel(meta_params); });

    DenseAttnDecodeParams p = {};
    p.b = batch; p.s_q = queries; p.q_seq_per_hk = rows; p.d = kDim; p.d_v = kLatent; p.h_q = kHeads; p.h_k = 1;
    p.num_blocks = num_blocks; p.q_head_per_hk = kHeads; p.is_causal = causal;
    p.scale_softmax = kScale; p.scale_softmax_log2 = float(kScale * M_LOG2E);
    p.q_ptr = q; p.k_ptr = cache; p.o_ptr = out; p.softmax_lse_ptr = lse;
    p.q_batch_stride = int64_t(rows) * kDim; p.k_batch_stride = int64_t(kPage) * kDim; p.o_batch_stride = int64_t(rows) * kLatent;
    p.q_row_stride = kDim; p.k_row_stride = kDim; p.o_row_stride = kLatent;
    p.q_head_stride = kDim; p.k_head_stride = kDim; p.o_head_stride = int64_t(rows) * kLatent;
    p.block_table = d_table; p.block_table_batch_stride = pages; p.page_block_size = kPage; p.seqlens_k_ptr = d_lengths;
    p.tile_scheduler_metadata_ptr = meta; p.num_sm_parts = num_sm_parts; p.num_splits_ptr = num_splits;
    p.total_num_splits = total_splits; p.softmax_lseaccum_ptr = lse_accum; p.oaccum_ptr = out_accum; p.stream = nullptr;
    CombineParams c = {batch, queries, kHeads, kLatent, lse, out, rows, kHeads, kHeads * queries * kLatent,
                       kHeads * kLatent, kLatent, lse_accum, out_accum, rows, kHeads, kHeads * queries * kLatent,
                       kHeads * kLatent, kLatent, meta, num_splits, num_sm_parts, nullptr, nullptr};
    Timing t = time_calls([&] {
        sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(p);
        smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
    }, iters, metadata_us);

    double max_err = 0;
    for (auto [b, s, h] : checked_rows(batch, queries, kHeads)) {
        std::vector<double> query(kDim);
        const uint64_t q_row = (uint64_t(b) * rows + uint64_t(s) * kHeads + h) * kDim;
        for (int j = 0; j < kDim; ++j) query[j] = bf16_of(q_seed, q_row + j);
        const int seen = causal ? context - queries + s + 1 : context;
        std::vector<std::vector<double>> keys(seen, std::vector<double>(kDim));
        for (int t2 = 0; t2 < seen; ++t2) {
            const uint64_t slot = uint64_t(table[b * pages + t2 / kPage]) * kPage + t2 % kPage;
            for (int j = 0; j < kDim; ++j) keys[t2][j] = bf16_of(k_seed, slot * kDim + j);
        }
        std::vector<double> want = attend(query, keys, kScale, kLatent);
        std::vector<cutlass::bfloat16_t> got(kLatent);
        CHECK(cudaMemcpy(got.data(), out + (uint64_t(b) * rows + uint64_t(s) * kHeads + h) * kLatent, kLatent * 2,
                         cudaMemcpyDeviceToHost));
        for (int j = 0; j < kLatent; ++j) max_err = std::max(max_err, std::abs(double(float(got[j])) - want[j]));
    }
    const double bytes = double(num_blocks) * kPage * kDim * 2 + double(q_size) * 2 + double(batch) * rows * kLatent * 2;
    // (a causal window's masked scores counted too, as kernels.py counts them)
    const double flops = 2.0 * batch * rows * double(context) * (kDim + kLatent);
    print_json("mla_attention", batch, context, queries, kHeads, -1, t, bytes, flops, max_err, num_sm_parts);
}

// A paged FP8 pool FlashMLA's sparse decode reads: its pages and their layout (bytes).
struct Pool { uint8_t* data; int num_blocks, page_bytes, token_bytes; };

// FlashMLA's sparse decode call over contiguous buffers, its parameters set as
// csrc/api/sparse_decode.h sets them from tensors (strides in elements, a pool's in bytes): queries
// [B, Q, heads, d_qk] filled from `q_seed`, outputs [B, Q, heads, d_v], `indices` [B, Q, topk] into
// `pool`, with V4 an `extra` pool and its `extra_indices` [B, Q, extra_topk] and per-head `sinks`;
// the split-KV scratch allocated and the scheduler metadata computed (and timed).
struct SparseCall {
    SparseAttnDecodeParams params;
    CombineParams combine;
    double metadata_us;
};

SparseCall sparse_call(ModelType model, int batch, int queries, int heads, int d_qk, int d_v, float scale,
                       uint64_t q_seed, Pool pool, const std::vector<int>& indices, int topk, Pool extra = {},
                       const std::vector<int>& extra_indices = {}, int extra_topk = 0, float* sinks = nullptr) {
    const int num_sm_parts = std::max(num_sms() / queries / (heads / 64), 1);
    const size_t rows = size_t(batch) * queries * heads;
    SparseAttnDecodeParams p = {};
    p.q = device_array<cutlass::bfloat16_t>(rows * d_qk);
    p.out = device_array<cutlass::bfloat16_t>(rows * d_v);
    p.lse = device_array<float>(rows);
    p.lse_accum = device_array<float>(size_t(batch + num_sm_parts) * queries * heads);
    p.o_accum = device_array<float>(size_t(batch + num_sm_parts) * queries * heads * d_v);
    p.num_splits_ptr = device_array<int>(batch + 1);
    p.tile_scheduler_metadata_ptr = device_array<DecodingSchedMeta>(num_sm_parts);
    fill_bf16<<<1024, 256>>>(p.q, rows * d_qk, q_seed);
    p.b = batch; p.s_q = queries; p.h_q = heads; p.h_kv = 1; p.d_qk = d_qk; p.d_v = d_v;
    p.sm_scale = scale; p.sm_scale_div_log2 = scale * 1.44269504f; p.model_type = model;
    p.kv = reinterpret_cast<cutlass::bfloat16_t*>(pool.data); p.num_blocks = pool.num_blocks; p.page_block_size = kPage;
    p.stride_kv_block = pool.page_bytes; p.stride_kv_row = pool.token_bytes;
    p.indices = to_device(indices); p.topk = topk; p.stride_indices_b = queries * topk; p.stride_indices_s_q = topk;
    if (extra.data) {
        p.extra_kv = reinterpret_cast<cutlass::bfloat16_t*>(extra.data); p.extra_num_blocks = extra.num_blocks;
        p.extra_page_block_size = kPage; p.stride_extra_kv_block = extra.page_bytes;
        p.stride_extra_kv_row = extra.token_bytes; p.extra_indices = to_device(extra_indices);
        p.extra_topk = extra_topk; p.stride_extra_indices_b = queries * extra_topk;
        p.stride_extra_indices_s_q = extra_topk;
    }
    p.attn_sink = sinks;
    p.stride_q_b = queries * heads * d_qk; p.stride_q_s_q = heads * d_qk; p.stride_q_h_q = d_qk;
    p.stride_lse_b = queries * heads; p.stride_lse_s_q = heads;
    p.stride_o_b = queries * heads * d_v; p.stride_o_s_q = heads * d_v; p.stride_o_h_q = d_v;
    p.stride_lse_accum_split = queries * heads; p.stride_lse_accum_s_q = heads;
    p.stride_o_accum_split = queries * heads * d_v; p.stride_o_accum_s_q = heads * d_v; p.stride_o_accum_h_q = d_v;
    p.num_sm_parts = num_sm_parts;
    GetDecodeSchedMetaParams meta = {batch, queries, 64, 5, topk, extra_topk, nullptr, nullptr, nullptr,
                                     p.tile_scheduler_metadata_ptr, p.num_splits_ptr, num_sm_parts, nullptr};
    const double metadata_us = time_once([&] { smxx::decode::run_get_decoding_sched_meta_kernel(meta); });
    CombineParams c = {batch, queries, heads, d_v, p.lse, p.out, p.stride_lse_b, p.stride_lse_s_q, p.stride_o_b,
                       p.stride_o_s_q, p.stride_o_h_q, p.lse_accum, p.o_accum, p.stride_lse_accum_split,
                       p.stride_lse_accum_s_q, p.stride_o_accum_split, p.stride_o_accum_s_q, p.stride_o_accum_h_q,
                       p.tile_scheduler_metadata_ptr, p.num_splits_ptr, num_sm_parts, sinks, nullptr};
    return {p, c, metadata_us};
}

void run_sparse(int batch, int context, int queries, int iters, int topk) {
    if (topk > context - queries + 1) {
        fprintf(stderr, "TOPK %d: the first query token sees only %d slots\n", topk, context - queries + 1);
        exit(2);
    }
    const int pages = (context + kPage - 1) / kPage, num_blocks = batch * pages;
    const uint64_t q_seed = 4, k_seed = 5;

    std::vector<int> table(num_blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(6));
    std::vector<int> indices(size_t(batch) * queries * topk);
    std::mt19937 rng(7);
    std::vector<int> order(context);
    for (int b = 0; b < batch; ++b)
        for (int s = 0; s < queries; ++s) {
            const int seen = context - queries + s + 1;
            std::iota(order.begin(), order.begin() + seen, 0);
            for (int k = 0; k < topk; ++k) {  // the first topk of a partial shuffle: distinct slots
                std::swap(order[k], order[k + rng() % (seen - k)]);
                const int t2 = order[k];
                indices[(size_t(b) * queries + s) * topk + k] = table[b * pages + t2 / kPage] * kPage + t2 % kPage;
            }
        }

    uint8_t* pool;
    CHECK(cudaMalloc(&pool, size_t(num_blocks) * kPage * kFp8Slot));
    fill_fp8_pool<<<1024, 256>>>(pool, uint64_t(num_blocks) * kPage, k_seed);
    auto [p, c, metadata_us] = sparse_call(ModelType::V32, batch, queries, kHeads, kDim, kLatent, kScale, q_seed,
                                           {pool, num_blocks, kPage * kFp8Slot, kFp8Slot}, indices, topk);
    const size_t q_size = size_t(batch) * queries * kHeads * kDim;
    Timing t = time_calls([&] {
        sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 128>(p);
        smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
    }, iters, metadata_us);

    double max_err = 0;
    for (auto [b, s, h] : checked_rows(batch, queries, kHeads)) {
        std::vector<double> query(kDim);
        const uint64_t q_row = ((uint64_t(b) * queries + s) * kHeads + h) * kDim;
        for (int j = 0; j < kDim; ++j) query[j] = bf16_of(q_seed, q_row + j);
        std::vector<std::vector<double>> keys(topk, std::vector<double>(kDim));
        for (int k = 0; k < topk; ++k) {
            const uint64_t slot = indices[(size_t(b) * queries + s) * topk + k];
            for (int j = 0; j < kLatent; ++j)
                keys[k][j] = double(fp8_value(fp8_byte(k_seed, slot * kLatent + j))) * fp8_scale(k_seed, slot, j / 128);
            for (int j = 0; j < 64; ++j) keys[k][kLatent + j] = bf16_of(k_seed + 1, slot * 64 + j);
        }
        std::vector<double> want = attend(query, keys, kScale, kLatent);
        std::vector<cutlass::bfloat16_t> got(kLatent);
        CHECK(cudaMemcpy(got.data(), p.out + ((uint64_t(b) * queries + s) * kHeads + h) * kLatent, kLatent * 2,
                         cudaMemcpyDeviceToHost));
        for (int j = 0; j < kLatent; ++j) max_err = std::max(max_err, std::abs(double(float(got[j])) - want[j]));
    }
    const double tokens = double(batch) * queries;
    const double bytes = tokens * topk * (kFp8Slot + 4) + double(q_size) * 2 + tokens * kHeads * kLatent * 2;
    const double flops = 2.0 * tokens * kHeads * topk * (kDim + kLatent);
    print_json("sparse_mla", batch, context, queries, kHeads, topk, t, bytes, flops, max_err, p.num_sm_parts);
}

// DeepSeek-V4-Flash's widths and FlashMLA's MODEL1 page: per slot 448 e4m3 and 64 bf16 RoPE
// values (576 bytes), the page's 64 slots of those first, then 8 scale bytes a slot (7 e8m0
// exponents, one per 64 values, and a pad byte), the page padded to a multiple of 576 bytes.
constexpr int kV4Heads = 64, kV4Dim = 512, kV4Nope = 448, kV4Window = 128, kV4Ring = 192;
constexpr int kV4Slot = kV4Nope + 64 * 2, kV4Token = kV4Slot + 8;
constexpr int kV4PageBytes = (kPage * kV4Token + 575) / 576 * 576;

__device__ __host__ inline uint8_t v4_scale_byte(uint64_t seed, uint64_t slot, int tile) {
    return uint8_t(120 + (mix(seed + 7 * slot + tile) & 3));  // 2^-7 .. 2^-4
}

__global__ void fill_model1_pool(uint8_t* pool, uint64_t pages, uint64_t seed) {
    for (uint64_t s = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; s < pages * kPage;
         s += uint64_t(gridDim.x) * blockDim.x) {
        uint8_t* page = pool + (s / kPage) * kV4PageBytes;
        uint8_t* values = page + (s % kPage) * kV4Slot;
        for (int j = 0; j < kV4Nope; ++j) values[j] = fp8_byte(seed, s * kV4Nope + j);
        cutlass::bfloat16_t* rope = reinterpret_cast<cutlass::bfloat16_t*>(values + kV4Nope);
        for (int j = 0; j < 64; ++j) rope[j] = cutlass::bfloat16_t(uniform(seed + 1, s * 64 + j));
        uint8_t* scales = page + kPage * kV4Slot + (s % kPage) * 8;
        for (int t = 0; t < 8; ++t) scales[t] = t < 7 ? v4_scale_byte(seed, s, t) : 0;
    }
}

// Slot s of a MODEL1 pool filled with `seed`, as FlashMLA dequantizes it: [512] values.
std::vector<double> model1_slot(uint64_t seed, uint64_t s) {
    std::vector<double> key(kV4Dim);
    for (int j = 0; j < kV4Nope; ++j)
        key[j] = double(fp8_value(fp8_byte(seed, s * kV4Nope + j))) * std::ldexp(1.0, v4_scale_byte(seed, s, j / 64) - 127);
    for (int j = 0; j < 64; ++j) key[kV4Nope + j] = bf16_of(seed + 1, s * 64 + j);
    return key;
}

void run_v4(int batch, int context, int queries, int iters, int rate, int topk) {
    if (rate < 1 || topk < 64 || topk % 64 != 0 || context < kV4Window + queries) {
        fprintf(stderr, "RATE must be >= 1, TOPK a positive multiple of 64, CONTEXT >= %d + QUERIES\n", kV4Window);
        exit(2);
    }
    const float scale = 1.0f / std::sqrt(float(kV4Dim));
    const int entries = context / rate, entry_pages = (entries + kPage - 1) / kPage, ring_pages = kV4Ring / kPage;
    const uint64_t q_seed = 8, entry_seed = 9, ring_seed = 10;

    std::vector<int> entry_table(batch * entry_pages), ring_table(batch * ring_pages);
    std::iota(entry_table.begin(), entry_table.end(), 0);
    std::iota(ring_table.begin(), ring_table.end(), 0);
    std::mt19937 rng(11);
    std::shuffle(entry_table.begin(), entry_table.end(), rng);
    std::shuffle(ring_table.begin(), ring_table.end(), rng);
    auto entry_slot = [&](int b, int e) { return entry_table[b * entry_pages + e / kPage] * kPage + e % kPage; };
    auto ring_slot = [&](int b, int position) {
        const int r = position % kV4Ring;
        return ring_table[b * ring_pages + r / kPage] * kPage + r % kPage;
    };
    std::vector<int> indices(size_t(batch) * queries * topk, -1), extra(size_t(batch) * queries * kV4Window);
    std::vector<int> order(std::max(entries, 1));
    for (int b = 0; b < batch; ++b)
        for (int s = 0; s < queries; ++s) {
            const int position = context - queries + s;
            const int seen = (position + 1) / rate;  // entry e closes at position (e + 1) * rate - 1
            const int chosen = std::min(seen, topk);
            std::iota(order.begin(), order.begin() + seen, 0);
            for (int k = 0; k < chosen; ++k) {
                if (chosen < seen) std::swap(order[k], order[k + rng() % (seen - k)]);
                indices[(size_t(b) * queries + s) * topk + k] = entry_slot(b, order[k]);
            }
            for (int w = 0; w < kV4Window; ++w)
                extra[(size_t(b) * queries + s) * kV4Window + w] = ring_slot(b, position - kV4Window + 1 + w);
        }
    std::vector<float> sinks(kV4Heads);
    for (int h = 0; h < kV4Heads; ++h) sinks[h] = uniform(12, h);

    uint8_t *entry_pool, *ring_pool;
    CHECK(cudaMalloc(&entry_pool, size_t(batch) * entry_pages * kV4PageBytes));
    CHECK(cudaMalloc(&ring_pool, size_t(batch) * ring_pages * kV4PageBytes));
    fill_model1_pool<<<1024, 256>>>(entry_pool, uint64_t(batch) * entry_pages, entry_seed);
    fill_model1_pool<<<1024, 256>>>(ring_pool, uint64_t(batch) * ring_pages, ring_seed);
    auto [p, c, metadata_us] = sparse_call(
        ModelType::MODEL1, batch, queries, kV4Heads, kV4Dim, kV4Dim, scale, q_seed,
        {entry_pool, batch * entry_pages, kV4PageBytes, kV4Token}, indices, topk,
        {ring_pool, batch * ring_pages, kV4PageBytes, kV4Token}, extra, kV4Window, to_device(sinks));
    const size_t rows = size_t(batch) * queries * kV4Heads, q_size = rows * kV4Dim;
    Timing t = time_calls([&] {
        sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, kV4Heads>(p);
        smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
    }, iters, metadata_us);

    double max_err = 0;
    int valid_total = 0;
    for (int index : indices) valid_total += index >= 0;
    for (auto [b, s, h] : checked_rows(batch, queries, kV4Heads)) {
        std::vector<double> query(kV4Dim);
        const uint64_t q_row = ((uint64_t(b) * queries + s) * kV4Heads + h) * kV4Dim;
        for (int j = 0; j < kV4Dim; ++j) query[j] = bf16_of(q_seed, q_row + j);
        std::vector<std::vector<double>> keys;
        for (int k = 0; k < topk; ++k) {
            const int slot = indices[(size_t(b) * queries + s) * topk + k];
            if (slot >= 0) keys.push_back(model1_slot(entry_seed, slot));
        }
        for (int w = 0; w < kV4Window; ++w)
            keys.push_back(model1_slot(ring_seed, extra[(size_t(b) * queries + s) * kV4Window + w]));
        std::vector<double> want = attend(query, keys, scale, kV4Dim, sinks[h]);
        std::vector<cutlass::bfloat16_t> got(kV4Dim);
        CHECK(cudaMemcpy(got.data(), p.out + q_row, kV4Dim * 2, cudaMemcpyDeviceToHost));
        for (int j = 0; j < kV4Dim; ++j) max_err = std::max(max_err, std::abs(double(float(got[j])) - want[j]));
    }
    // Every token's keys read once (its selected entries and its window), its index lists, queries
    // and outputs; flops of every listed key.
    const double tokens = double(batch) * queries;
    const double bytes = (double(valid_total) + tokens * kV4Window) * kV4Token + (double(indices.size()) + extra.size()) * 4
                         + double(q_size) * 2 + double(rows) * kV4Dim * 2;
    const double flops = 4.0 * rows * (topk + kV4Window) * kV4Dim;
    print_json(rate == 4 ? "v4_csa" : rate == 128 ? "v4_hca" : "v4", batch, context, queries, kV4Heads, topk, t, bytes,
               flops, max_err, p.num_sm_parts);
}

// Bytes/s of a device-to-device copy of `mib` MiB (read + write), the median of 20 after warm-up.
void run_copy(int mib) {
    const size_t n = size_t(mib) << 20;
    void *a, *b;
    CHECK(cudaMalloc(&a, n));
    CHECK(cudaMalloc(&b, n));
    CHECK(cudaMemset(a, 1, n));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    Timing t = time_calls([&] { CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); }, 20, 0);
    printf("{\"op\": \"copy\", \"device\": \"%s\", \"bytes\": %.0f, \"median_us\": %.3f, \"bytes_per_s\": %.6g}\n",
           prop.name, 2.0 * n, t.median_us, 2.0 * n / (t.median_us * 1e-6));
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 3 && std::string(argv[1]) == "copy" && atoi(argv[2]) >= 1) {
        run_copy(atoi(argv[2]));
        return 0;
    }
    const int needed = argc < 2 ? 0 : std::string(argv[1]) == "dense" ? 6 : std::string(argv[1]) == "sparse" ? 7
                       : std::string(argv[1]) == "v4" ? 8 : 0;
    if (needed == 0 || argc < needed) {
        fprintf(stderr, "usage: %s dense BATCH CONTEXT QUERIES ITERS | sparse BATCH CONTEXT QUERIES ITERS TOPK | "
                "v4 BATCH CONTEXT QUERIES ITERS RATE TOPK | copy MIB\n", argv[0]);
        return 2;
    }
    const int batch = atoi(argv[2]), context = atoi(argv[3]), queries = atoi(argv[4]), iters = atoi(argv[5]);
    if (batch < 1 || context < queries || queries < 1 || iters < 1) {
        fprintf(stderr, "BATCH, QUERIES and ITERS must be >= 1 and CONTEXT >= QUERIES\n");
        return 2;
    }
    const std::string mode = argv[1];
    if (mode == "dense") run_dense(batch, context, queries, iters);
    else if (mode == "sparse") run_sparse(batch, context, queries, iters, atoi(argv[6]));
    else run_v4(batch, context, queries, iters, atoi(argv[6]), atoi(argv[7]));
    return 0;
}

// oneDNN's C++ API with every call into libdnnl.so.3 made through run_time_libraries.h.
// dnnl.hpp is a header-only layer over the C functions of dnnl.h: the C declarations come
// first, then each function the core reaches is named as a macro for its run-time pointer,
// then dnnl.hpp, whose inline calls expand to those pointers. A C function missing here is
// an undefined symbol, which the core's link refuses (--no-undefined): add it below.
#pragma once

#include <oneapi/dnnl/dnnl.h>

#include "run_time_libraries.h"

#define GG_ONEDNN(name) GG_RUN_TIME_FUNCTION(::groupgemm::cpu::kOnednnLibrary, name)

#define dnnl_engine_create GG_ONEDNN(dnnl_engine_create)
#define dnnl_engine_destroy GG_ONEDNN(dnnl_engine_destroy)
#define dnnl_get_effective_cpu_isa GG_ONEDNN(dnnl_get_effective_cpu_isa)
#define dnnl_matmul_primitive_desc_create GG_ONEDNN(dnnl_matmul_primitive_desc_create)
#define dnnl_memory_create_v2 GG_ONEDNN(dnnl_memory_create_v2)
#define dnnl_memory_desc_clone GG_ONEDNN(dnnl_memory_desc_clone)
#define dnnl_memory_desc_create_with_strides GG_ONEDNN(dnnl_memory_desc_create_with_strides)
#define dnnl_memory_desc_create_with_tag GG_ONEDNN(dnnl_memory_desc_create_with_tag)
#define dnnl_memory_desc_destroy GG_ONEDNN(dnnl_memory_desc_destroy)
#define dnnl_memory_desc_get_size_v2 GG_ONEDNN(dnnl_memory_desc_get_size_v2)
#define dnnl_memory_destroy GG_ONEDNN(dnnl_memory_destroy)
#define dnnl_post_ops_append_sum GG_ONEDNN(dnnl_post_ops_append_sum)
#define dnnl_post_ops_create GG_ONEDNN(dnnl_post_ops_create)
#define dnnl_post_ops_destroy GG_ONEDNN(dnnl_post_ops_destroy)
#define dnnl_primitive_attr_create GG_ONEDNN(dnnl_primitive_attr_create)
#define dnnl_primitive_attr_destroy GG_ONEDNN(dnnl_primitive_attr_destroy)
#define dnnl_primitive_attr_set_post_ops GG_ONEDNN(dnnl_primitive_attr_set_post_ops)
#define dnnl_primitive_attr_set_scratchpad_mode GG_ONEDNN(dnnl_primitive_attr_set_scratchpad_mode)
#define dnnl_primitive_create GG_ONEDNN(dnnl_primitive_create)
#define dnnl_primitive_desc_destroy GG_ONEDNN(dnnl_primitive_desc_destroy)
#define dnnl_primitive_desc_query GG_ONEDNN(dnnl_primitive_desc_query)
#define dnnl_primitive_desc_query_md GG_ONEDNN(dnnl_primitive_desc_query_md)
#define dnnl_primitive_destroy GG_ONEDNN(dnnl_primitive_destroy)
#define dnnl_primitive_execute GG_ONEDNN(dnnl_primitive_execute)
#define dnnl_reorder_primitive_desc_create GG_ONEDNN(dnnl_reorder_primitive_desc_create)
#define dnnl_set_primitive_cache_capacity GG_ONEDNN(dnnl_set_primitive_cache_capacity)
#define dnnl_stream_create GG_ONEDNN(dnnl_stream_create)
#define dnnl_stream_destroy GG_ONEDNN(dnnl_stream_destroy)
#define dnnl_stream_wait GG_ONEDNN(dnnl_stream_wait)

#include <oneapi/dnnl/dnnl.hpp>

// How a kernel source registers its ops: into the namespace of the instruction-set level it is
// being compiled for (torch.ops.pipellm_avx2, torch.ops.pipellm_avx512, ...), which
// pipellm/kernels/cpu_kernels.py passes as PIPELLM_OPS_NAMESPACE. One library per level, each
// in its own namespace, lets one process hold several levels (tests compare them) and choose
// one at run time.
#pragma once

#include <torch/library.h>

#ifndef PIPELLM_OPS_NAMESPACE
#error "build with -DPIPELLM_OPS_NAMESPACE=pipellm_<level> (see pipellm/kernels/cpu_kernels.py)"
#endif

// Two steps, so that PIPELLM_OPS_NAMESPACE is expanded before TORCH_LIBRARY_FRAGMENT pastes it.
#define PIPELLM_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define PIPELLM_LIBRARY_FRAGMENT(m) PIPELLM_LIBRARY_FRAGMENT_(PIPELLM_OPS_NAMESPACE, m)

// cuBLASLt, opened at run time, and one handle per device.
//
// jaxfuse is built against the cuBLASLt header but does not link the library: importing
// jaxfuse on a machine without a GPU (CI) or without cuBLAS must work. The first CUDA
// handler that needs cuBLASLt opens libcublasLt.so.<major>, which jax's CUDA plugin has
// normally loaded already (jaxfuse's Python side preloads the nvidia-cublas wheel's copy).
#pragma once

#include <cublasLt.h>

#include <string>

namespace jaxfuse::cublaslt {

struct Api {
  decltype(&::cublasLtCreate) Create;
  decltype(&::cublasLtDestroy) Destroy;
  decltype(&::cublasLtGetVersion) GetVersion;
  decltype(&::cublasLtGetStatusString) GetStatusString;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmulAlgoConfigGetAttribute) MatmulAlgoConfigGetAttribute;
  decltype(&::cublasLtMatmul) Matmul;
};

// The loaded API, or nullptr with `error` set when the library cannot be opened.
const Api* GetApi(std::string* error);

// The cuBLASLt handle of a device, created on first use (thread-safe). Handles live as
// long as the process; cuBLASLt handles carry no stream and may be shared by threads.
cublasStatus_t GetHandle(int device_ordinal, cublasLtHandle_t* handle);

// Version of the cuBLASLt library that is loaded (0 when none could be opened).
size_t LoadedVersion();

std::string StatusString(cublasStatus_t status);

}  // namespace jaxfuse::cublaslt

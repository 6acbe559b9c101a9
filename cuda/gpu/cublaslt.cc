#include "cublaslt.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <mutex>
#include <unordered_map>

namespace jaxfuse::cublaslt {
namespace {

#define JAXFUSE_STR2(x) #x
#define JAXFUSE_STR(x) JAXFUSE_STR2(x)

struct Loaded {
  Api api{};
  bool ok = false;
  std::string error;
};

const Loaded& Load() {
  static const Loaded loaded = [] {
    Loaded result;
    const char* candidates[] = {"libcublasLt.so." JAXFUSE_STR(CUBLAS_VER_MAJOR), "libcublasLt.so"};
    void* library = nullptr;
    for (const char* name : candidates) {
      library = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
      if (library) break;
    }
    if (!library) {
      result.error = std::string("could not open libcublasLt.so." JAXFUSE_STR(CUBLAS_VER_MAJOR)
                                 " (install nvidia-cublas or jax[cuda13]): ") + dlerror();
      return result;
    }
    bool complete = true;
    auto bind = [&](auto& slot, const char* symbol) {
      slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(library, symbol));
      if (!slot) {
        complete = false;
        result.error += std::string(" missing symbol ") + symbol + ";";
      }
    };
    Api& api = result.api;
    bind(api.Create, "cublasLtCreate");
    bind(api.Destroy, "cublasLtDestroy");
    bind(api.GetVersion, "cublasLtGetVersion");
    bind(api.GetStatusString, "cublasLtGetStatusString");
    bind(api.MatmulDescCreate, "cublasLtMatmulDescCreate");
    bind(api.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
    bind(api.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
    bind(api.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
    bind(api.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
    bind(api.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
    bind(api.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
    bind(api.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
    bind(api.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
    bind(api.MatmulAlgoConfigGetAttribute, "cublasLtMatmulAlgoConfigGetAttribute");
    bind(api.Matmul, "cublasLtMatmul");
    result.ok = complete;
    if (!complete) result.error = "libcublasLt is incomplete:" + result.error;
    return result;
  }();
  return loaded;
}

}  // namespace

const Api* GetApi(std::string* error) {
  const Loaded& loaded = Load();
  if (!loaded.ok) {
    if (error) *error = loaded.error;
    return nullptr;
  }
  return &loaded.api;
}

cublasStatus_t GetHandle(int device_ordinal, cublasLtHandle_t* handle) {
  static std::mutex mutex;
  static std::unordered_map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto found = handles.find(device_ordinal); found != handles.end()) {
    *handle = found->second;
    return CUBLAS_STATUS_SUCCESS;
  }
  const Api* api = GetApi(nullptr);
  if (!api) return CUBLAS_STATUS_NOT_INITIALIZED;
  // cublasLtCreate binds to the current device: switch to the one asked for, then back.
  int previous = 0;
  cudaGetDevice(&previous);
  if (previous != device_ordinal) cudaSetDevice(device_ordinal);
  const cublasStatus_t status = api->Create(handle);
  if (previous != device_ordinal) cudaSetDevice(previous);
  if (status == CUBLAS_STATUS_SUCCESS) handles.emplace(device_ordinal, *handle);
  return status;
}

size_t LoadedVersion() {
  const Api* api = GetApi(nullptr);
  return api ? api->GetVersion() : 0;
}

std::string StatusString(cublasStatus_t status) {
  const Api* api = GetApi(nullptr);
  if (api) return api->GetStatusString(status);
  return "cuBLAS status " + std::to_string(static_cast<int>(status));
}

}  // namespace jaxfuse::cublaslt

/* TEST-ONLY stand-in for the NVIDIA driver library (libcuda.so.1) on a machine with no GPU.
 *
 * sgl_kernel's CUDA common_ops and mooncake's engine.so link libcuda.so.1, so neither loads
 * without one. Every driver entry point here reports CUDA_ERROR_NO_DEVICE; the error-string
 * calls answer with a message. Built with gcc at test time by
 * eldr_sglang.testing.sglang_cpu.stub; never shipped, never used by the product. */
#include <stddef.h>

#define CUDA_ERROR_NO_DEVICE 100
typedef int CUresult;

static const char NO_DEVICE_NAME[] = "CUDA_ERROR_NO_DEVICE";
static const char NO_DEVICE_TEXT[] = "no CUDA-capable device is detected (libcuda test stub)";

CUresult cuGetErrorString(CUresult error, const char **str) {
    (void)error;
    if (str) *str = NO_DEVICE_TEXT;
    return 0;
}

CUresult cuGetErrorName(CUresult error, const char **str) {
    (void)error;
    if (str) *str = NO_DEVICE_NAME;
    return 0;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags, void *status) {
    (void)symbol; (void)version; (void)flags; (void)status;
    if (pfn) *pfn = NULL;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, void *status) {
    return cuGetProcAddress(symbol, pfn, version, flags, status);
}

/* The rest only need to exist and fail: callers check the result before using outputs. */
#define NO_DEVICE(name) CUresult name(void) { return CUDA_ERROR_NO_DEVICE; }
NO_DEVICE(cuInit)
NO_DEVICE(cuDriverGetVersion)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuPointerSetAttribute)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemExportToShareableHandle)
NO_DEVICE(cuMemImportFromShareableHandle)
NO_DEVICE(cuMemRetainAllocationHandle)
NO_DEVICE(cuMemGetHandleForAddressRange)
NO_DEVICE(cuMemGetAddressRange_v2)

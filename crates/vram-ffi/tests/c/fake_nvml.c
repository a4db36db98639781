/* A stand-in for NVML (libnvidia-ml.so.1), built by tests/driver_abi.rs, for the tests of
 * libvram.so's nvmlDeviceGetMemoryInfo hooks on a machine without a GPU. Mechanics only: two
 * "devices", the first with the UUID of the test daemon's host device ("host-0"), the second
 * another GPU, both 80 GiB with 70 GiB free. The proof against the real NVML is the GPU run. */
#include <string.h>

typedef int nvmlReturn_t;
typedef struct fake_device *nvmlDevice_t;
struct fake_device {
    const char *uuid;
};
static struct fake_device DEVICES[2] = {{"host-0"}, {"GPU-00000000-1111-2222-3333-444444444444"}};

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

nvmlReturn_t nvmlInit_v2(void) { return 0; }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (index >= 2)
        return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *device = &DEVICES[index];
    return 0;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (strlen(device->uuid) + 1 > length)
        return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    strcpy(uuid, device->uuid);
    return 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    (void)device;
    memory->total = 80ULL << 30;
    memory->free = 70ULL << 30;
    memory->used = 10ULL << 30;
    return 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    (void)device;
    if (memory->version != ((unsigned int)sizeof(nvmlMemory_v2_t) | (2u << 24)))
        return 25; /* NVML_ERROR_ARGUMENT_VERSION_MISMATCH */
    memory->total = 80ULL << 30;
    memory->reserved = 1ULL << 30;
    memory->free = 70ULL << 30;
    memory->used = 9ULL << 30;
    return 0;
}

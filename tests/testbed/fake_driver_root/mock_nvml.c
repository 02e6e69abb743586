/*
 * A stand-in for the NVIDIA driver's libnvidia-ml.so.1 (NVML) on machines without NVIDIA hardware.
 *
 * It implements, with the real ABI (C types, struct layouts, struct-version words, return codes), exactly
 * the entry points the service calls through pynvml (imex/nvml.py):
 *   nvmlInit_v2, nvmlInitWithFlags, nvmlShutdown, nvmlErrorString, nvmlSystemGetDriverVersion,
 *   nvmlDeviceGetCount_v2, nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetName, nvmlDeviceGetUUID,
 *   nvmlDeviceGetGpuFabricInfoV (struct v3 and v2), nvmlDeviceGetGpuFabricInfo (the unversioned struct).
 * Anything else is absent, so a new call in the service fails loudly (pynvml: NVML_ERROR_FUNCTION_NOT_FOUND)
 * instead of getting an invented answer.
 *
 * Its answers come from "nvml-mock.conf" in the directory the library was loaded from (each fake driver
 * root has its own copy of the library and of the file), re-read by every nvmlInit that starts a session
 * (reference count 0 -> 1), so a test can change a node's fabric state while the service runs, as Fabric
 * Manager does on a real node. Format: "key = value" lines, "#" comments; unknown keys are an error.
 *   driver_version = 570.172.08        gpu_count = 4                 gpu_name = NVIDIA GB200
 *   fabric_state = 3 (0 NOT_SUPPORTED, 1 NOT_STARTED, 2 IN_PROGRESS, 3 COMPLETED)
 *   fabric_status = 0 (the registration's nvmlReturn_t)          clique_id = 1
 *   cluster_uuid = 6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40            fabric_supported = 1
 *   fabric_info_version = 3 (newest fabric-info struct the "driver" knows: 3, 2, or 1 = no versioned call)
 *   gpu<N>.uuid|name|fabric_state|fabric_status|cluster_uuid|clique_id = per-GPU override
 *
 * Where it differs from the real library:
 * - no kernel driver behind it: a missing or unreadable nvml-mock.conf makes nvmlInit return
 *   NVML_ERROR_DRIVER_NOT_LOADED (what the real library says without nvidia.ko), a malformed one
 *   NVML_ERROR_UNKNOWN with the reason on stderr;
 * - an older driver is modelled by fabric_info_version: the versioned call then answers
 *   NVML_ERROR_ARGUMENT_VERSION_MISMATCH (v3 on a v2 driver) or NVML_ERROR_FUNCTION_NOT_FOUND (no versioned
 *   call), where the real old library would lack the symbol (pynvml reports the same code either way);
 * - health fields of the fabric info (healthMask, healthSummary) are always 0 (not supported);
 * - NVML_INIT_FLAG_NO_GPUS and the other init flags are accepted and ignored; device queries need an
 *   active session (NVML_ERROR_UNINITIALIZED otherwise), as in the real library;
 * - error strings follow the real library's wording but are not guaranteed to match it word for word.
 * The real library is tested on hardware by the gpu lane (tests/gpu).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 64
#define TEXT 96
#define UUID_LEN 16
#define CONF_NAME "nvml-mock.conf"
#define MAX_CONF_BYTES 65536

struct nvmlDevice_st {
    unsigned index;
    char uuid[TEXT];
    char name[TEXT];
    unsigned fabric_state;
    int fabric_status;
    unsigned char cluster_uuid[UUID_LEN];
    unsigned clique_id;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

/* Layouts and version words as in nvml.h (state is an unsigned char there). */
typedef struct {
    unsigned char clusterUuid[UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
} nvmlGpuFabricInfo_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
} nvmlGpuFabricInfo_v2_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
    unsigned char healthSummary;
} nvmlGpuFabricInfo_v3_t;

#define STRUCT_VERSION(type, v) ((unsigned int)(sizeof(type) | ((v) << 24U)))
_Static_assert(STRUCT_VERSION(nvmlGpuFabricInfo_v2_t, 2) == 0x02000024, "v2 layout");
_Static_assert(STRUCT_VERSION(nvmlGpuFabricInfo_v3_t, 3) == 0x03000028, "v3 layout");

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int refcount;
static char driver_version[TEXT];
static unsigned gpu_count;
static unsigned fabric_info_version;
static int fabric_supported;
static struct nvmlDevice_st gpus[MAX_GPUS];

static int parse_uuid(const char *text, unsigned char out[UUID_LEN]) {
    unsigned n = 0;
    for (const char *p = text; *p; p++) {
        if (*p == '-') continue;
        if (!isxdigit((unsigned char)p[0]) || !isxdigit((unsigned char)p[1]) || n >= UUID_LEN) return -1;
        char byte[3] = {p[0], p[1], 0};
        out[n++] = (unsigned char)strtoul(byte, NULL, 16);
        p++;
    }
    return n == UUID_LEN ? 0 : -1;
}

static int parse_uint(const char *text, unsigned long max, unsigned long *out) {
    char *end;
    errno = 0;
    unsigned long v = strtoul(text, &end, 10);
    if (errno || end == text || *end || v > max || text[0] == '-') return -1;
    *out = v;
    return 0;
}

static int copy_text(char *dst, const char *src) {
    if (strlen(src) >= TEXT) return -1;
    strcpy(dst, src);
    return 0;
}

/* One GPU field (shared by the node-wide keys and the gpu<N>. overrides). 1: not a GPU field. */
static int set_gpu_field(struct nvmlDevice_st *gpu, const char *key, const char *value) {
    unsigned long v;
    if (!strcmp(key, "uuid")) return copy_text(gpu->uuid, value);
    if (!strcmp(key, "name")) return copy_text(gpu->name, value);
    if (!strcmp(key, "fabric_state")) {
        if (parse_uint(value, 3, &v)) return -1;
        gpu->fabric_state = (unsigned)v;
        return 0;
    }
    if (!strcmp(key, "fabric_status")) {
        if (parse_uint(value, 0x7fffffff, &v)) return -1;
        gpu->fabric_status = (int)v;
        return 0;
    }
    if (!strcmp(key, "cluster_uuid")) return parse_uuid(value, gpu->cluster_uuid);
    if (!strcmp(key, "clique_id")) {
        if (parse_uint(value, 0xffffffffUL, &v)) return -1;
        gpu->clique_id = (unsigned)v;
        return 0;
    }
    return 1;
}

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1])) *--end = 0;
    return s;
}

static int conf_path(char *out, size_t size) {
    Dl_info info;
    if (!dladdr((void *)&conf_path, &info) || !info.dli_fname) return -1;
    const char *slash = strrchr(info.dli_fname, '/');
    size_t dir = slash ? (size_t)(slash - info.dli_fname) : 1;
    const char *base = slash ? info.dli_fname : ".";
    if (dir + 1 + sizeof CONF_NAME > size) return -1;
    memcpy(out, base, dir);
    snprintf(out + dir, size - dir, "/%s", CONF_NAME);
    return 0;
}

static nvmlReturn_t load_conf(void) {
    char path[4096];
    if (conf_path(path, sizeof path)) return NVML_ERROR_DRIVER_NOT_LOADED;
    FILE *f = fopen(path, "r");
    if (!f) return NVML_ERROR_DRIVER_NOT_LOADED;
    static char text[MAX_CONF_BYTES + 1];
    size_t n = fread(text, 1, MAX_CONF_BYTES + 1, f);
    fclose(f);
    if (n > MAX_CONF_BYTES) {
        fprintf(stderr, "mock libnvidia-ml: %s: larger than %d bytes\n", path, MAX_CONF_BYTES);
        return NVML_ERROR_UNKNOWN;
    }
    text[n] = 0;

    struct nvmlDevice_st node = {.fabric_state = 0};
    strcpy(node.name, "NVIDIA GB200");
    strcpy(driver_version, "570.172.08");
    unsigned long count = 0;
    unsigned long version = 3;
    unsigned long supported = 1;
    /* Per-GPU overrides are applied after the node-wide values, whatever the line order. */
    struct override { unsigned gpu; char key[32]; char value[TEXT]; } overrides[256];
    unsigned n_overrides = 0;

    int line_no = 0;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        line_no++;
        char *s = trim(line);
        if (!*s || *s == '#') continue;
        char *eq = strchr(s, '=');
        if (!eq) goto bad;
        *eq = 0;
        char *key = trim(s), *value = trim(eq + 1);
        unsigned long gpu;
        int r;
        if (!strncmp(key, "gpu", 3) && isdigit((unsigned char)key[3])) {
            char *dot = strchr(key, '.');
            if (!dot || n_overrides >= 256 || strlen(dot + 1) >= 32 || strlen(value) >= TEXT) goto bad;
            *dot = 0;
            if (parse_uint(key + 3, MAX_GPUS - 1, &gpu)) goto bad;
            overrides[n_overrides].gpu = (unsigned)gpu;
            strcpy(overrides[n_overrides].key, dot + 1);
            strcpy(overrides[n_overrides].value, value);
            n_overrides++;
            continue;
        }
        if (!strcmp(key, "driver_version")) r = copy_text(driver_version, value);
        else if (!strcmp(key, "gpu_count")) r = parse_uint(value, MAX_GPUS, &count);
        else if (!strcmp(key, "gpu_name")) r = copy_text(node.name, value);
        else if (!strcmp(key, "fabric_info_version")) r = parse_uint(value, 3, &version) || version < 1;
        else if (!strcmp(key, "fabric_supported")) r = parse_uint(value, 1, &supported);
        else r = set_gpu_field(&node, key, value);
        if (r) goto bad;
        continue;
    bad:
        fprintf(stderr, "mock libnvidia-ml: %s:%d: bad line (unknown key or value out of range)\n", path, line_no);
        return NVML_ERROR_UNKNOWN;
    }
    gpu_count = (unsigned)count;
    fabric_info_version = (unsigned)version;
    fabric_supported = (int)supported;
    for (unsigned i = 0; i < MAX_GPUS; i++) {
        gpus[i] = node;
        gpus[i].index = i;
        snprintf(gpus[i].uuid, TEXT, "GPU-00000000-0000-4000-8000-%012u", i);
    }
    for (unsigned i = 0; i < n_overrides; i++) {
        if (set_gpu_field(&gpus[overrides[i].gpu], overrides[i].key, overrides[i].value)) {
            fprintf(stderr, "mock libnvidia-ml: %s: bad override gpu%u.%s\n", path, overrides[i].gpu, overrides[i].key);
            return NVML_ERROR_UNKNOWN;
        }
    }
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    nvmlReturn_t r = NVML_SUCCESS;
    if (refcount == 0) r = load_conf();
    if (r == NVML_SUCCESS) refcount++;
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t r = refcount > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (refcount > 0) refcount--;
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 25: return "Argument version mismatch";
    case 27: return "Not Ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t active(void) { return refcount > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED; }

static nvmlReturn_t put_text(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

static nvmlReturn_t device(nvmlDevice_t handle, struct nvmlDevice_st **out) {
    if (active()) return NVML_ERROR_UNINITIALIZED;
    if (handle < gpus || handle >= gpus + gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    *out = handle;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (active()) return NVML_ERROR_UNINITIALIZED;
    return put_text(version, length, driver_version);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (active()) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = gpu_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *handle) {
    if (active()) return NVML_ERROR_UNINITIALIZED;
    if (!handle || index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    *handle = &gpus[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t handle, char *name, unsigned int length) {
    struct nvmlDevice_st *gpu;
    nvmlReturn_t r = device(handle, &gpu);
    return r ? r : put_text(name, length, gpu->name);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t handle, char *uuid, unsigned int length) {
    struct nvmlDevice_st *gpu;
    nvmlReturn_t r = device(handle, &gpu);
    return r ? r : put_text(uuid, length, gpu->uuid);
}

static void fill(const struct nvmlDevice_st *gpu, unsigned char uuid[UUID_LEN], nvmlReturn_t *status,
                 unsigned int *clique, unsigned char *state) {
    memcpy(uuid, gpu->cluster_uuid, UUID_LEN);
    *status = gpu->fabric_status;
    *clique = gpu->clique_id;
    *state = (unsigned char)gpu->fabric_state;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t handle, nvmlGpuFabricInfo_t *info) {
    struct nvmlDevice_st *gpu;
    nvmlReturn_t r = device(handle, &gpu);
    if (r) return r;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (!fabric_supported) return NVML_ERROR_NOT_SUPPORTED;
    fill(gpu, info->clusterUuid, &info->status, &info->cliqueId, &info->state);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t handle, void *info) {
    struct nvmlDevice_st *gpu;
    nvmlReturn_t r = device(handle, &gpu);
    if (r) return r;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (fabric_info_version < 2) return NVML_ERROR_FUNCTION_NOT_FOUND;
    unsigned int version;
    memcpy(&version, info, sizeof version);
    if (version == STRUCT_VERSION(nvmlGpuFabricInfo_v3_t, 3) && fabric_info_version >= 3) {
        nvmlGpuFabricInfo_v3_t *v3 = info;
        if (!fabric_supported) return NVML_ERROR_NOT_SUPPORTED;
        fill(gpu, v3->clusterUuid, &v3->status, &v3->cliqueId, &v3->state);
        v3->healthMask = 0;
        v3->healthSummary = 0;
        return NVML_SUCCESS;
    }
    if (version == STRUCT_VERSION(nvmlGpuFabricInfo_v2_t, 2)) {
        nvmlGpuFabricInfo_v2_t *v2 = info;
        if (!fabric_supported) return NVML_ERROR_NOT_SUPPORTED;
        fill(gpu, v2->clusterUuid, &v2->status, &v2->cliqueId, &v2->state);
        v2->healthMask = 0;
        return NVML_SUCCESS;
    }
    return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
}

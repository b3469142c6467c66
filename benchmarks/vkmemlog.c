/*
 * vkmemlog: log every Vulkan device-memory allocation of a process, for the
 * offload cells of benchmarks/plan_accuracy.py (see benchmarks/gpu_memory.py).
 *
 * Loaded with LD_PRELOAD into llama-server; it wraps vkAllocateMemory,
 * vkMapMemory and vkFreeMemory (llama.cpp's Vulkan backend calls the loader's
 * exported functions: vulkan.hpp's static dispatch) and appends one line per
 * call to the file named by VKMEMLOG:
 *
 *   A <memory> <bytes> <type index> <0|1 imported host pointer>
 *   M <memory> <address> <bytes mapped>
 *   F <memory>
 *
 * Nothing else changes: every call is passed on unchanged. With Mesa's
 * lavapipe, device memory is ordinary memory of the process, so the benchmark
 * can read how much of each allocation is resident from /proc/PID/pagemap.
 *
 * Build: cc -O2 -shared -fPIC -o vkmemlog.so vkmemlog.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <vulkan/vulkan.h>

static int log_fd = -2;

static void log_line(const char *line, int len)
{
    if (log_fd == -2) {
        const char *path = getenv("VKMEMLOG");
        log_fd = path ? open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600) : -1;
    }
    if (log_fd >= 0 && len > 0) {
        ssize_t unused = write(log_fd, line, (size_t)len);
        (void)unused;
    }
}

static int imports_host_pointer(const VkMemoryAllocateInfo *info)
{
    for (const VkBaseInStructure *s = info->pNext; s != NULL; s = s->pNext) {
        if (s->sType == VK_STRUCTURE_TYPE_IMPORT_MEMORY_HOST_POINTER_INFO_EXT) {
            return 1;
        }
    }
    return 0;
}

VKAPI_ATTR VkResult VKAPI_CALL vkAllocateMemory(VkDevice device,
                                                const VkMemoryAllocateInfo *info,
                                                const VkAllocationCallbacks *alloc,
                                                VkDeviceMemory *memory)
{
    static PFN_vkAllocateMemory real;
    if (!real) {
        real = (PFN_vkAllocateMemory)dlsym(RTLD_NEXT, "vkAllocateMemory");
    }
    VkResult r = real(device, info, alloc, memory);
    if (r == VK_SUCCESS) {
        char line[160];
        int n = snprintf(line, sizeof line, "A %llx %llu %u %d\n",
                         (unsigned long long)(uintptr_t)*memory,
                         (unsigned long long)info->allocationSize, info->memoryTypeIndex,
                         imports_host_pointer(info));
        log_line(line, n);
    }
    return r;
}

VKAPI_ATTR VkResult VKAPI_CALL vkMapMemory(VkDevice device, VkDeviceMemory memory,
                                           VkDeviceSize offset, VkDeviceSize size,
                                           VkMemoryMapFlags flags, void **data)
{
    static PFN_vkMapMemory real;
    if (!real) {
        real = (PFN_vkMapMemory)dlsym(RTLD_NEXT, "vkMapMemory");
    }
    VkResult r = real(device, memory, offset, size, flags, data);
    if (r == VK_SUCCESS) {
        char line[160];
        int n = snprintf(line, sizeof line, "M %llx %llx %llu\n",
                         (unsigned long long)(uintptr_t)memory,
                         (unsigned long long)(uintptr_t)*data, (unsigned long long)size);
        log_line(line, n);
    }
    return r;
}

VKAPI_ATTR void VKAPI_CALL vkFreeMemory(VkDevice device, VkDeviceMemory memory,
                                        const VkAllocationCallbacks *alloc)
{
    static PFN_vkFreeMemory real;
    if (!real) {
        real = (PFN_vkFreeMemory)dlsym(RTLD_NEXT, "vkFreeMemory");
    }
    if (memory != VK_NULL_HANDLE) {
        char line[64];
        int n = snprintf(line, sizeof line, "F %llx\n", (unsigned long long)(uintptr_t)memory);
        log_line(line, n);
    }
    real(device, memory, alloc);
}

/* The C shim of the ucx fabric: UCX's parameter structs and unions hidden behind plain functions.
 *
 * Not compiled on its own: build.py has cffi generate the binding's C file, which includes this file
 * (so everything here is static, and the binding is one translation unit). What Python may call is
 * declared for cffi in shim_cdef.h. build.py defines TT_BUILT_AGAINST (where the UCX comes from)
 * before including this file. Completion is observed by polling request status, never by calling
 * back into Python from UCX.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* ppoll */
#endif
#include <dlfcn.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <errno.h>
#include <signal.h>
#include <linux/futex.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include <uct/api/uct.h>

/* A CUDA context current on every thread that calls UCX. UCX's CUDA transports (cuda_copy, cuda_ipc) call the CUDA
   driver from whichever thread calls UCX (progress, arm, put, get, flush), and the driver needs a context current
   there: without one, arming a worker segfaults in cuEventQuery. tt_cuda_use(device) retains that device's primary
   context (the one CuPy, PyTorch and CUDA's runtime use) once; tt_cuda_enter(), first thing in each entry point
   that calls UCX, makes it current on a thread that has none, once per thread (a thread's own context is left
   alone). The driver is opened with dlopen: the shim links no CUDA library, and without a GPU none of this runs. */
static void *tt_cuda_context;
static int (*tt_cu_ctx_get_current)(void **);
static int (*tt_cu_ctx_set_current)(void *);
static int (*tt_cu_mem_get_address_range)(uintptr_t *, size_t *, uintptr_t);
static __thread int tt_cuda_entered;

static void tt_cuda_enter(void)
{
    void *current = NULL;
    if (tt_cuda_context == NULL || tt_cuda_entered) {
        return;
    }
    tt_cuda_entered = 1;
    if (tt_cu_ctx_get_current(&current) == 0 && current == NULL) {
        tt_cu_ctx_set_current(tt_cuda_context);
    }
}

/* Hold CUDA device `device`'s primary context for tt_cuda_enter: 0 once held (or held already), else the driver's
   error (a CUresult), or -1 when the driver or one of its functions is missing. */
static int tt_cuda_use(int device)
{
    int (*init)(unsigned), (*device_get)(int *, int), (*retain)(void **, int);
    void *driver, *context = NULL;
    int handle = 0, status;
    if (tt_cuda_context != NULL) {
        return 0;
    }
    driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (driver == NULL) {
        return -1;
    }
    init = (int (*)(unsigned))dlsym(driver, "cuInit");
    device_get = (int (*)(int *, int))dlsym(driver, "cuDeviceGet");
    retain = (int (*)(void **, int))dlsym(driver, "cuDevicePrimaryCtxRetain");
    tt_cu_ctx_get_current = (int (*)(void **))dlsym(driver, "cuCtxGetCurrent");
    tt_cu_ctx_set_current = (int (*)(void *))dlsym(driver, "cuCtxSetCurrent");
    tt_cu_mem_get_address_range = (int (*)(uintptr_t *, size_t *, uintptr_t))dlsym(driver, "cuMemGetAddressRange_v2");
    if (!init || !device_get || !retain || !tt_cu_ctx_get_current || !tt_cu_ctx_set_current ||
        !tt_cu_mem_get_address_range) {
        return -1;
    }
    if ((status = init(0)) != 0 || (status = device_get(&handle, device)) != 0 ||
        (status = retain(&context, handle)) != 0) {
        return status;
    }
    tt_cuda_context = context;
    return 0;
}

/* The device allocation `address` lies in, as the driver knows it (cuMemGetAddressRange: an allocation of this
   process, or a peer's that CUDA IPC mapped here): 0 with its start and size, else the driver's error (a CUresult),
   or -1 when no CUDA context is held (tt_cuda_use). */
static int tt_cuda_range(uintptr_t address, uintptr_t *base, size_t *size)
{
    if (tt_cuda_context == NULL) {
        return -1;
    }
    tt_cuda_enter();
    return tt_cu_mem_get_address_range(base, size, address);
}

/* tls: UCX_TLS ("" leaves UCX's choice); names/values: further settings, as UCX_<name> */
static ucs_status_t tt_init(const char *tls, char **names, char **values, int count, ucp_context_h *context)
{
    ucp_config_t *config;
    ucp_params_t params;
    int i;
    ucs_status_t status = ucp_config_read(NULL, NULL, &config);
    if (status != UCS_OK) {
        return status;
    }
    if (tls != NULL && tls[0] != '\0') {
        status = ucp_config_modify(config, "TLS", tls);
    }
    for (i = 0; status == UCS_OK && i < count; i++) {
        status = ucp_config_modify(config, names[i], values[i]);
    }
    if (status != UCS_OK) {
        ucp_config_release(config);
        return status;
    }
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;
    status = ucp_init(&params, config, context);
    ucp_config_release(config);
    return status;
}

/* Progress until `idle_rounds` calls in a row find nothing to do; returns the events handled.
   Staying in C for a whole burst of traffic keeps the progress thread from taking the GIL
   after every event. */
static unsigned long tt_progress_burst(ucp_worker_h worker, unsigned idle_rounds)
{
    unsigned long total = 0;
    unsigned idle = 0;
    tt_cuda_enter();
    while (idle < idle_rounds) {
        unsigned events = ucp_worker_progress(worker);
        total += events;
        idle = events ? 0 : idle + 1;
    }
    return total;
}

/* Whether this UCX knows setting UCX_<name> and accepts `value` (IB settings need IB transports). */
static ucs_status_t tt_config_accepts(const char *name, const char *value)
{
    ucp_config_t *config;
    ucs_status_t status = ucp_config_read(NULL, NULL, &config);
    if (status != UCS_OK) {
        return status;
    }
    status = ucp_config_modify(config, name, value);
    ucp_config_release(config);
    return status;
}

/* 1 when this UCX offers transport `name` of UCT component `component` on this host, else 0: the component's
   memory domains are opened and their transports listed, as UCP does. Asked of the shared-memory transports
   (posix, sysv, xpmem, knem, cma: each its own component's) and the CUDA ones (cuda_copy, of component cuda_cpy;
   cuda_ipc), which a host without a GPU does not offer. */
static int tt_offers_tl(const char *component, const char *name)
{
    uct_component_h *components;
    unsigned count, c, m, t, resources;
    int found = 0;
    if (uct_query_components(&components, &count) != UCS_OK) {
        return 0;
    }
    for (c = 0; c < count && !found; c++) {
        uct_component_attr_t attr;
        uct_md_resource_desc_t *mds;
        memset(&attr, 0, sizeof(attr));
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
        if (uct_component_query(components[c], &attr) != UCS_OK || strcmp(attr.name, component) != 0 ||
            attr.md_resource_count == 0) {
            continue;
        }
        mds = calloc(attr.md_resource_count, sizeof(*mds));
        if (mds == NULL) {
            break;
        }
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        attr.md_resources = mds;
        if (uct_component_query(components[c], &attr) == UCS_OK) {
            for (m = 0; m < attr.md_resource_count && !found; m++) {
                uct_md_config_t *config;
                uct_md_h md;
                uct_tl_resource_desc_t *tls;
                if (uct_md_config_read(components[c], NULL, NULL, &config) != UCS_OK) {
                    continue;
                }
                if (uct_md_open(components[c], mds[m].md_name, config, &md) == UCS_OK) {
                    if (uct_md_query_tl_resources(md, &tls, &resources) == UCS_OK) {
                        for (t = 0; t < resources; t++) {
                            found = found || strcmp(tls[t].tl_name, name) == 0;
                        }
                        uct_release_tl_resource_list(tls);
                    }
                    uct_md_close(md);
                }
                uct_config_release(config);
            }
        }
        free(mds);
    }
    uct_release_component_list(components);
    return found;
}

#define TT_DOORBELL_AM 1

/* A doorbell carries nothing: its arrival wakes the target's progress thread, which is all
   it is for (the role a completion event of a verbs write-with-immediate plays). */
static ucs_status_t tt_on_doorbell(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param)
{
    (void)arg;
    (void)header;
    (void)header_length;
    (void)data;
    (void)length;
    (void)param;
    return UCS_OK;
}

static ucs_status_t tt_worker_create(ucp_context_h context, ucp_worker_h *worker)
{
    ucp_worker_params_t params;
    ucp_am_handler_param_t handler;
    ucs_status_t status;
    tt_cuda_enter();
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    params.thread_mode = UCS_THREAD_MODE_MULTI;
    status = ucp_worker_create(context, &params, worker);
    if (status != UCS_OK) {
        return status;
    }
    memset(&handler, 0, sizeof(handler));
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB;
    handler.id = TT_DOORBELL_AM;
    handler.cb = tt_on_doorbell;
    status = ucp_worker_set_am_recv_handler(*worker, &handler);
    if (status != UCS_OK) {
        ucp_worker_destroy(*worker);
    }
    return status;
}

static ucs_status_ptr_t tt_doorbell(ucp_ep_h ep)
{
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
    return ucp_am_send_nbx(ep, TT_DOORBELL_AM, NULL, 0, NULL, 0, &param);
}

static void tt_on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    *(volatile int *)arg = (int)status;
}

/* peer_errors: ask UCX to detect and report a failed peer (not all shared-memory
   transports support it, so it is off for them) */
static ucs_status_t tt_ep_create(ucp_worker_h worker, const void *address, int peer_errors, int *error_slot,
                                 ucp_ep_h *ep)
{
    ucp_ep_params_t params;
    tt_cuda_enter();
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = (const ucp_address_t *)address;
    params.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    params.err_handler.cb = tt_on_ep_error;
    params.err_handler.arg = error_slot;
    return ucp_ep_create(worker, &params, ep);
}

static ucs_status_ptr_t tt_ep_close(ucp_ep_h ep, int force)
{
    ucp_request_param_t param;
    tt_cuda_enter();
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    return ucp_ep_close_nbx(ep, &param);
}

static ucs_status_ptr_t tt_ep_flush(ucp_ep_h ep)
{
    ucp_request_param_t param;
    tt_cuda_enter();
    memset(&param, 0, sizeof(param));
    return ucp_ep_flush_nbx(ep, &param);
}

static char *tt_ep_info(ucp_ep_h ep)
{
    char *text = NULL;
    size_t length = 0;
    FILE *stream = open_memstream(&text, &length);
    if (stream == NULL) {
        return NULL;
    }
    ucp_ep_print_info(ep, stream);
    fclose(stream);
    return text;
}

static ucs_status_t tt_mem_map(ucp_context_h context, void *address, size_t length, ucp_mem_h *memh)
{
    ucp_mem_map_params_t params;
    tt_cuda_enter();
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    params.address = address;
    params.length = length;
    params.flags = address == NULL ? UCP_MEM_MAP_ALLOCATE : 0;
    return ucp_mem_map(context, &params, memh);
}

static void *tt_mem_address(ucp_mem_h memh, size_t *length)
{
    ucp_mem_attr_t attr;
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    if (ucp_mem_query(memh, &attr) != UCS_OK) {
        return NULL;
    }
    *length = attr.length;
    return attr.address;
}

static ucs_status_ptr_t tt_put(ucp_ep_h ep, const void *buffer, size_t length, uint64_t remote_addr,
                               ucp_rkey_h rkey)
{
    ucp_request_param_t param;
    tt_cuda_enter();
    param.op_attr_mask = 0;
    return ucp_put_nbx(ep, buffer, length, remote_addr, rkey, &param);
}

static ucs_status_ptr_t tt_get(ucp_ep_h ep, void *buffer, size_t length, uint64_t remote_addr,
                               ucp_rkey_h rkey)
{
    ucp_request_param_t param;
    tt_cuda_enter();
    param.op_attr_mask = 0;
    return ucp_get_nbx(ep, buffer, length, remote_addr, rkey, &param);
}

/* ---- the per-transfer path: one call per transfer and side, the GIL released (cffi does) ---- */

/* empty progress calls in a row before a waiting thread yields its core */
#define TT_YIELD_AFTER 64
/* a waiter that stopped spinning sleeps this long at first, doubling up to TT_SHORT_NAP_NS for
   TT_PATIENT_NS, then up to TT_LONG_NAP_NS: an idle receiver wakes a thousand times a second
   (one-sided writes into mapped memory raise no event a sleeper could block on; over tcp one does) */
#define TT_FIRST_NAP_NS 20000
#define TT_SHORT_NAP_NS 100000
#define TT_PATIENT_NS 20000000
#define TT_LONG_NAP_NS 1000000
/* while spinning, a waiter watches the memory alone this long between yields of its core (a write into mapped
   memory needs no progress to land): the moment a flag goes up is seen within a few loads, not after a
   progress call and a yield. 10 us, not 1: a progress call and a yield every microsecond left a tenth of the
   spin blind, and a 1KB transfer in a user's loop took 3.5 us (median of 3 rounds) against 2.8 */
#define TT_WATCH_NS 10000
#define TT_WAIT_TIMED_OUT -1
#define TT_WAIT_STOPPED -2

/* a hint to the core that this thread is polling memory */
static void tt_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t tt_now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* Sleep up to `ns` on the doorbell word `bell` (a futex, shared between processes: the word lies in memory
   the peer maps) while it holds 1. */
static void tt_doze(volatile uint32_t *bell, int64_t ns)
{
    struct timespec timeout = {ns / 1000000000, ns % 1000000000};
    syscall(SYS_futex, bell, FUTEX_WAIT, 1, &timeout, NULL, 0);
}

/* After a write into peer memory mapped here: wake the peer if it sleeps on the doorbell `bell` (it set the word
   to 1, then looked at the memory once more). The full fence orders the write before the look at the word, as
   the sleeper's orders its 1 before its look at the memory: one of the two sees the other's. */
static int tt_ring(volatile uint32_t *bell)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(bell, __ATOMIC_RELAXED) == 0) {
        return 0;
    }
    __atomic_store_n(bell, 0, __ATOMIC_RELAXED);
    syscall(SYS_futex, bell, FUTEX_WAKE, 1, NULL, NULL, 0);
    return 1;
}

/* Progress `worker` from this thread until `request` (a *_nbx result) completes, `*stop` is set
   `*failed` (the endpoint's error slot) is set, or `deadline_ns` passes; the request is freed either
   way (UCX finishes it on its own). While a
   transfer of ours is in flight this thread never sleeps, it only yields its core when idle. */
static ucs_status_t tt_finish(ucp_worker_h worker, ucs_status_ptr_t request, int64_t deadline_ns,
                              volatile int *stop, volatile int *failed)
{
    ucs_status_t status;
    unsigned idle = 0;
    tt_cuda_enter();
    if (request == NULL) {
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(request)) {
        return UCS_PTR_STATUS(request);
    }
    for (;;) {
        idle = ucp_worker_progress(worker) ? 0 : idle + 1;
        status = ucp_request_check_status(request);
        if (status != UCS_INPROGRESS) {
            break;
        }
        if (*failed) { /* the connection failed: UCX said so, or the transport found the peer dead */
            status = (ucs_status_t)*failed;
            break;
        }
        if (*stop || tt_now_ns() > deadline_ns) {
            status = UCS_ERR_TIMED_OUT;
            break;
        }
        if (idle >= TT_YIELD_AFTER) {
            sched_yield();
            idle = 0;
        }
    }
    ucp_request_free(request);
    return status;
}

/* put `length` bytes and flush: when it returns UCS_OK they are at the target */
static ucs_status_t tt_put_flushed(ucp_worker_h worker, ucp_ep_h ep, const void *data, size_t length,
                                   uint64_t remote, ucp_rkey_h rkey, int64_t deadline_ns, volatile int *stop,
                                   volatile int *failed)
{
    ucs_status_ptr_t put = tt_put(ep, data, length, remote, rkey);
    if (UCS_PTR_IS_ERR(put)) {
        return UCS_PTR_STATUS(put);
    }
    if (put != NULL) {
        ucp_request_free(put); /* the flush below completes after it */
    }
    return tt_finish(worker, tt_ep_flush(ep), deadline_ns, stop, failed);
}

/* One transfer: write the data, fence, write the trailer (whose last byte is the flag), flush. The fence makes
   the data land before the trailer. Host memory: ucp_worker_fence, weak (one round trip where a flush between
   the two took two: over tcp, a 1KB transfer's time). Where `flush_between` is set (the device moves device
   memory: a put from or into GPU memory is a GPU copy UCX completes later, which a weak fence lets the flag's
   shared-memory put overtake) the fence is a flush of the endpoint, bounded by the same deadline, stop word
   and error slot as the rest: a strong ucp_worker_fence waits for it too, but spins without a bound, so a
   copy that never completes (a sticky CUDA error) would hang the sender. Either part may be empty.
   UCS_ERR_TIMED_OUT: the deadline passed or `*stop` was set; the buffers may still be read by UCX afterwards,
   so the caller keeps them alive. */
static ucs_status_t tt_put_flagged(ucp_worker_h worker, ucp_ep_h ep, const void *data, size_t length,
                                   uint64_t remote, ucp_rkey_h rkey, const void *trailer, size_t trailer_length,
                                   uint64_t trailer_remote, ucp_rkey_h trailer_rkey, int flush_between,
                                   int64_t timeout_ns, volatile int *stop, volatile int *failed)
{
    int64_t deadline = tt_now_ns() + timeout_ns;
    ucs_status_t status;
    ucs_status_ptr_t put;
    tt_cuda_enter();
    if (length == 0 || trailer_length == 0) {
        return length ? tt_put_flushed(worker, ep, data, length, remote, rkey, deadline, stop, failed)
                      : tt_put_flushed(worker, ep, trailer, trailer_length, trailer_remote, trailer_rkey, deadline,
                                       stop, failed);
    }
    put = tt_put(ep, data, length, remote, rkey);
    if (UCS_PTR_IS_ERR(put)) {
        return UCS_PTR_STATUS(put);
    }
    if (put != NULL) {
        ucp_request_free(put); /* the flush below completes after it */
    }
    status = flush_between ? tt_finish(worker, tt_ep_flush(ep), deadline, stop, failed) : ucp_worker_fence(worker);
    if (status != UCS_OK) {
        return status;
    }
    return tt_put_flushed(worker, ep, trailer, trailer_length, trailer_remote, trailer_rkey, deadline, stop, failed);
}

/* Copy with non-temporal stores where the CPU has them (x86-64: SSE2's, 64 bytes a round), else memcpy: the
   lines go to memory without being read for ownership first, so a copy into lines another core holds does not
   pull each one from that core's cache. The stores are fenced (sfence) before it returns: a flag stored after
   them is seen after them. */
static void tt_copy_streaming(void *target, const void *data, size_t length)
{
#if defined(__x86_64__)
    uint8_t *to = target;
    const uint8_t *from = data;
    size_t head = (16 - ((uintptr_t)to & 15)) & 15;
    if (head > length) {
        head = length;
    }
    memcpy(to, from, head);
    to += head;
    from += head;
    length -= head;
    for (; length >= 64; length -= 64, to += 64, from += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)from), b = _mm_loadu_si128((const __m128i *)(from + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(from + 32)), d = _mm_loadu_si128((const __m128i *)(from + 48));
        _mm_stream_si128((__m128i *)to, a);
        _mm_stream_si128((__m128i *)(to + 16), b);
        _mm_stream_si128((__m128i *)(to + 32), c);
        _mm_stream_si128((__m128i *)(to + 48), d);
    }
    memcpy(to, from, length);
    _mm_sfence();
#else
    memcpy(target, data, length);
#endif
}

/* One transfer into peer memory mapped in this process (shared memory: the pointers ucp_rkey_ptr gives for
   the targets, checked against the peer's segment by the caller): the data copied in place, then the trailer
   with its last byte (the flag) stored last, after a release fence, so a reader that sees the flag sees
   everything before it. Without a trailer, the data (counters) goes in aligned 8-byte stores where it
   can, so a reader never sees a torn counter. What ucp_put's shared-memory path does, without UCX's
   choice of a single-copy kernel call (cma) for writes over a few KB, which costs twice a memcpy. */
static void tt_write_mapped(void *target, const void *data, size_t length, uint8_t *trailer_target,
                            const uint8_t *trailer, size_t trailer_length)
{
    if (trailer_length == 0 && length % 8 == 0 && (uintptr_t)target % 8 == 0 && (uintptr_t)data % 8 == 0) {
        size_t i;
        for (i = 0; i < length / 8; i++) {
            __atomic_store_n((uint64_t *)target + i, ((const uint64_t *)data)[i], __ATOMIC_RELAXED);
        }
    } else if (length) {
        memcpy(target, data, length);
    }
    if (trailer_length) {
        __atomic_thread_fence(__ATOMIC_RELEASE);
        memcpy(trailer_target, trailer, trailer_length - 1);
        __atomic_store_n(trailer_target + trailer_length - 1, trailer[trailer_length - 1], __ATOMIC_RELEASE);
    }
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Map every page of [address, address + length) writable in this process now (peer memory mapped here that
   transfers will write), so that no transfer pays the page faults of its first write. 0, or -1 where the
   kernel cannot (older than 5.14): the faults then come with the first transfers, as before. */
static int tt_populate(void *address, size_t length)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)address / page * page;
    uintptr_t end = ((uintptr_t)address + length + page - 1) / page * page;
    return length ? madvise((void *)start, end - start, MADV_POPULATE_WRITE) : 0;
}

/* A static tensor's sends towards one peer, planned once (zerocopy's sender, once connected): where each
   slot and its trailer lie at the peer (mapped here, or an address and key to put to), the staging trailer
   (step, then the flag byte) and the credit counter the peer writes. */
#define TT_MAX_SLOTS 2
/* A slot's bell, in the receiver's control block beside the slot's trailer: how the two sides of a planned
   transfer over shared memory (the sender maps the block) signal each other besides the flag.
   - `doorbell`: the receiver sleeps on it (a futex) while it holds 1; a sender that wrote rings it (tt_ring).
   - `waiting`: seq + 1 while the receiver waits in a take of transfer seq that serves pulls (tt_take_planned),
     else 0; `taker` its process.
   - a pull: a sender of TT_PULL_FROM bytes or more that finds the receiver waiting for its transfer asks it to
     copy the data itself (`giver` and `source`: the sender's process and data; `pull`: tt_pull_word(seq, state)),
     then waits for it to be done, and writes the trailer. The copy then ends in the reader's cache, not the
     writer's: where the two cores share no cache the writer's copy runs at a fraction of the reader's (64MB
     and a reduce-max of it, measured here: 8.0-8.9 ms written against 5.7-6.3 ms read). A sender whose ask
     is not taken up (the receiver left its take) withdraws it and writes as usual. */
typedef struct {
    uint32_t doorbell;
    uint32_t giver;
    uint32_t taker;
    uint32_t unused;
    uint64_t waiting;
    uint64_t pull;
    uint64_t source;
} tt_bell;

/* BELL_BYTES in transports/fabric/base.py: the receiver's control block holds one per slot */
_Static_assert(sizeof(tt_bell) == 40, "a bell is BELL_BYTES (40) bytes");

#define TT_PULL_ASKED 1
#define TT_PULL_TAKEN 2
#define TT_PULL_DONE 3
#define TT_PULL_FAILED 4
/* a planned send over shared memory of this many bytes or more asks a waiting receiver to pull it (TT_STREAM_ALWAYS_FROM:
   the smallest copy that goes with non-temporal stores, the way a pull can beat) */
#define TT_PULL_FROM (32 << 10)

static uint64_t tt_pull_word(uint64_t seq, uint64_t state)
{
    return (seq + 1) << 3 | state;
}

typedef struct {
    ucp_worker_h worker;
    ucp_ep_h ep;
    int slots;
    size_t length;
    uint64_t remote[TT_MAX_SLOTS];
    ucp_rkey_h rkey[TT_MAX_SLOTS];
    void *mapped[TT_MAX_SLOTS];
    uint64_t trailer_remote[TT_MAX_SLOTS];
    ucp_rkey_h trailer_rkey[TT_MAX_SLOTS];
    uint8_t *trailer_mapped[TT_MAX_SLOTS];
    uint8_t *trailer;
    uint64_t *posted;
    /* how its waits go, the same for every send: the spin, the device's stop word, the endpoint's error slot,
       the workers a wait progresses */
    int64_t spin_ns;
    volatile int *stop;
    volatile int *failed;
    ucp_worker_h *workers;
    int nworkers;
    /* how long a send waits for its credit before it returns TT_NO_CREDIT, and for its transfer to complete */
    int64_t credit_wait_ns;
    int64_t timeout_ns;
    /* how its copies into mapped memory (of TT_STREAM_FROM bytes or more) go (see tt_copy_mapped): with
       non-temporal stores or not, the copies since the other kind was last timed, and each kind's time */
    int streaming;
    unsigned since_timed;
    int64_t took_ns[2];
    /* each slot's bell at the peer, mapped here (its doorbell rung after a write there: tt_ring; pulls asked
       there), or NULL; the times the peer slept on one and was woken; the transfers the peer pulled; whether
       pulls are off (the peer could not read this process's memory); this process */
    tt_bell *bell[TT_MAX_SLOTS];
    uint64_t rung;
    uint64_t pulled;
    int pulls_off;
    uint32_t pid;
    /* whether a send that may ask for a pull does (tt_pull_or_write): the sends since the other way was last
       timed, and each way's time (written, pulled) */
    int pulling;
    unsigned since_pull_timed;
    int64_t pull_took_ns[2];
    /* the device's count of transfers written by this process's own copy into mapped memory, or NULL */
    uint64_t *mapped_writes;
    /* tt_put_flagged's flush_between: data and trailer are ordered by a bounded flush, not a fence */
    int flush_between;
} tt_send_plan;

#define TT_NO_CREDIT 1
#define TT_SEND_STOPPED 2

static int tt_wait_counter(uint64_t *word, uint64_t above, int64_t spin_ns, int64_t timeout_ns,
                           volatile int *stop, ucp_worker_h *workers, int nworkers);

/* Send `seq` of a planned tensor, the whole per-transfer path in one call: wait (spinning, then napping) up to
   `credit_wait_ns` for its credit (the peer's receive of the transfer `slots` before it consumed: receives
   posted > seq + 1 - slots), write `data` into slot seq % slots, then the trailer (`step`, the flag
   1 + seq % 255 last). Returns UCS_OK, TT_NO_CREDIT (nothing written: the caller checks the peer and
   calls again), TT_SEND_STOPPED, or UCX's error. */
/* A copy into mapped memory of this many bytes or more chooses its stores (tt_copy_mapped) */
#define TT_STREAM_FROM (1 << 20)
/* a smaller copy of this many bytes or more always goes with non-temporal stores: a core that writes lines the peer's
   core holds takes each from it first, at a pace that depends on where the host put the two virtual CPUs (64KB, a
   user's loop with a fresh source and a reduce-max, medians of 2000: 12.8-13.1 us with ordinary stores where the
   cores share a cache, 37.2 where they did not; 9.5-10.3 with non-temporal ones in both; 512KB: 49-56 against
   39-40); the reader then reads the lines from memory, which under 1MB costs it less than the writer saves */
#define TT_STREAM_ALWAYS_FROM (32 << 10)
/* every this many copies goes with the stores not chosen, timed, to find out whether they still cost more */
#define TT_STREAM_RETIME 32
/* non-temporal stores are chosen only when ordinary ones take this many times as long: the reader then finds the
   data in memory, not in the writer's cache, which the writer's time does not show (4MB where the cores share a
   cache, measured here: with non-temporal stores the transfer took 100 us and the reader's reduce 110, with
   ordinary ones 72 and 42) */
#define TT_STREAM_GAIN 2

/* The last-level cache's size (Linux's sysfs for the first CPU's level-3 cache; 32MB where it does not say. glibc's
   sysconf said 384MB in this VM, the host's whole cache): a copy larger than it leaves no data in the cache for
   the reader whatever its stores, so there non-temporal stores are chosen whenever they take less time (1GB here:
   42 against 51 ms with ordinary stores) */
static size_t tt_cache_bytes(void)
{
    static size_t bytes;
    if (bytes == 0) {
        unsigned long size = 0;
        char unit = 0;
        FILE *file = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
        if (file != NULL) {
            if (fscanf(file, "%lu%c", &size, &unit) < 1) {
                size = 0;
            }
            fclose(file);
        }
        size <<= unit == 'K' ? 10 : unit == 'M' ? 20 : 0;
        bytes = size ? (size_t)size : (size_t)32 << 20;
    }
    return bytes;
}

/* A planned send's copy of `length` bytes into peer memory mapped here, with ordinary stores, or non-temporal
   ones where those took less than 1 / TT_STREAM_GAIN of their time lately (less time at all for a copy larger
   than the cache) (the kind in use timed as an average,
   a new copy weighing a quarter; the other by its last retime). A core that writes lines the peer's core holds (the peer read its last transfer)
   takes each from it first; where the two cores share a cache that is fast (1MB at 30 GB/s measured here),
   where they share none it runs at a fraction of it (6.6 GB/s), and non-temporal stores, which write the lines
   to memory unread, win (18 GB/s; the peer then reads them from memory). Which of the two a run gets depends
   on where the host places its virtual CPUs, and can change within a run: so each kind is tried once first, then
   every TT_STREAM_RETIME-th copy goes the other way, timed. */
static void tt_copy_mapped(tt_send_plan *plan, void *target, const void *data, size_t length)
{
    int64_t start, took;
    int streaming = plan->streaming;
    if (length < TT_STREAM_FROM) {
        if (length >= TT_STREAM_ALWAYS_FROM) {
            tt_copy_streaming(target, data, length);
        } else if (length) {
            memcpy(target, data, length);
        }
        return;
    }
    if (!plan->took_ns[0] || !plan->took_ns[1]) { /* each kind tried once first */
        streaming = plan->took_ns[0] != 0;
    } else if (++plan->since_timed >= TT_STREAM_RETIME) {
        streaming = !streaming;
        plan->since_timed = 0;
    }
    start = tt_now_ns();
    if (streaming) {
        tt_copy_streaming(target, data, length);
    } else {
        memcpy(target, data, length);
    }
    took = tt_now_ns() - start;
    /* the kind in use keeps an average; a retimed one takes its fresh time (its last may be 32 copies old) */
    plan->took_ns[streaming] = plan->took_ns[streaming] && streaming == plan->streaming
                                   ? (3 * plan->took_ns[streaming] + took) / 4
                                   : took;
    plan->streaming = plan->took_ns[1] &&
                      (length > tt_cache_bytes() ? 1 : TT_STREAM_GAIN) * plan->took_ns[1] < plan->took_ns[0];
}

/* Ask the receiver, which waits in a take of transfer `seq` (bell->waiting), to pull `data` (see tt_bell), and
   wait until it has: 1 once pulled (`data` is free again), 0 when not (the receiver left its take before it took
   the ask up, or could not read this process's memory: then pulls are off for the plan); the caller then writes.
   TT_WAIT_STOPPED, or TT_WAIT_TIMED_OUT after the plan's timeout or when the receiver's process is gone. */
static int tt_pulled(tt_send_plan *plan, tt_bell *bell, const void *data, uint64_t seq, uint8_t *trailer_target)
{
    uint64_t asked = tt_pull_word(seq, TT_PULL_ASKED), word;
    int64_t start = tt_now_ns(), now, watched;
    memcpy(trailer_target, plan->trailer, 8); /* the step: the receiver raises the flag itself once it pulled */
    bell->giver = plan->pid;
    bell->source = (uint64_t)(uintptr_t)data;
    __atomic_store_n(&bell->pull, asked, __ATOMIC_SEQ_CST);
    tt_ring(&bell->doorbell);
    for (;;) {
        word = __atomic_load_n(&bell->pull, __ATOMIC_ACQUIRE);
        if (word == tt_pull_word(seq, TT_PULL_DONE) || word == tt_pull_word(seq, TT_PULL_FAILED)) {
            __atomic_store_n(&bell->pull, 0, __ATOMIC_RELAXED);
            if (word == tt_pull_word(seq, TT_PULL_DONE)) {
                plan->pulled++;
                return 1;
            }
            plan->pulls_off = 1;
            return 0;
        }
        if (word == asked && __atomic_load_n(&bell->waiting, __ATOMIC_ACQUIRE) != seq + 1 &&
            __atomic_compare_exchange_n(&bell->pull, &word, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            return 0; /* withdrawn before the receiver took it up */
        }
        if (*plan->stop) {
            return TT_WAIT_STOPPED;
        }
        now = tt_now_ns();
        if (now - start > plan->timeout_ns || (bell->taker && kill((pid_t)bell->taker, 0) != 0 && errno == ESRCH)) {
            return TT_WAIT_TIMED_OUT;
        }
        watched = now + TT_WATCH_NS;
        while (__atomic_load_n(&bell->pull, __ATOMIC_RELAXED) == word && tt_now_ns() < watched) {
            tt_relax();
        }
        sched_yield();
    }
}

/* Whether the receiver waiting at `bell` is a process this one can see (the one a pull's wait watches: see
   tt_pulled); one in another pid namespace is not, nor can it read this process's memory: pulls go off. */
static int tt_taker_here(tt_send_plan *plan, tt_bell *bell)
{
    pid_t taker = (pid_t)__atomic_load_n(&bell->taker, __ATOMIC_RELAXED);
    if (taker > 0 && kill(taker, 0) == 0) {
        return 1;
    }
    plan->pulls_off = 1;
    return 0;
}

/* Whether a copy of the plan's length into mapped memory goes with non-temporal stores now (tt_copy_mapped) */
static int tt_writes_streaming(const tt_send_plan *plan)
{
    return plan->length < TT_STREAM_FROM ? plan->length >= TT_STREAM_ALWAYS_FROM : plan->streaming;
}

/* every this many sends that may ask for a pull go the way not chosen, timed */
#define TT_PULL_RETIME 16

/* A send of transfer `seq` whose receiver waits for it (see tt_bell): asked to pull, or written here into
   `target`, whichever took less time lately (each way tried once first, then the one not chosen every
   TT_PULL_RETIME-th send, as tt_copy_mapped times its stores). Which one wins depends on where the two cores
   are, as there: where they share a cache a write here ran faster (16MB: 1002 against 1067 us with a
   reduce-max), where they share none the pull (64MB: 5.7 against 8.9 ms). 0 once there, or TT_WAIT_* */
static int tt_pull_or_write(tt_send_plan *plan, tt_bell *bell, void *target, const void *data, uint64_t seq,
                            uint8_t *trailer_target)
{
    int64_t start, took, written;
    int pull = plan->pulling, found = 0;
    if (!plan->pull_took_ns[0] || !plan->pull_took_ns[1]) {
        pull = !plan->pull_took_ns[1];
    } else if (++plan->since_pull_timed >= TT_PULL_RETIME) {
        pull = !pull;
        plan->since_pull_timed = 0;
    }
    start = tt_now_ns();
    if (pull) {
        found = tt_pulled(plan, bell, data, seq, trailer_target);
        if (found < 0) {
            return found;
        }
    }
    if (!found) {
        tt_copy_mapped(plan, target, data, plan->length);
    }
    took = tt_now_ns() - start;
    if (pull == found) { /* a way taken as meant is timed (an ask not taken up is not the pull's time) */
        plan->pull_took_ns[pull] = plan->pull_took_ns[pull] && pull == plan->pulling
                                       ? (3 * plan->pull_took_ns[pull] + took) / 4
                                       : took;
    }
    written = plan->pull_took_ns[0];
    if (tt_writes_streaming(plan) && plan->length <= tt_cache_bytes()) {
        written *= TT_STREAM_GAIN; /* the reader then reads the lines from memory, which a writer's time omits */
    }
    plan->pulling = plan->pull_took_ns[1] && (!written || plan->pull_took_ns[1] < written);
    return found;
}

static int tt_send_planned(tt_send_plan *plan, const void *data, uint64_t seq, int64_t step)
{
    volatile int *stop = plan->stop, *failed = plan->failed;
    int slot = (int)(seq % (uint64_t)plan->slots);
    ucs_status_t status;
    if (*(volatile uint64_t *)plan->posted + (uint64_t)plan->slots <= seq + 1) {
        int found = tt_wait_counter(plan->posted, seq + 1 - (uint64_t)plan->slots, plan->spin_ns,
                                    plan->credit_wait_ns, stop, plan->workers, plan->nworkers);
        if (found == TT_WAIT_STOPPED) {
            return TT_SEND_STOPPED;
        }
        if (found != 1) {
            return TT_NO_CREDIT;
        }
    }
    if (*failed) {
        return *failed;
    }
    memcpy(plan->trailer, &step, sizeof(step));
    plan->trailer[8] = (uint8_t)(1 + seq % 255);
    if ((plan->mapped[slot] != NULL || plan->length == 0) && plan->trailer_mapped[slot] != NULL) {
        tt_bell *bell = plan->bell[slot];
        int pulled = 0;
        if (bell != NULL && plan->length >= TT_PULL_FROM && !plan->pulls_off &&
            __atomic_load_n(&bell->waiting, __ATOMIC_ACQUIRE) == seq + 1 && tt_taker_here(plan, bell)) {
            pulled = tt_pull_or_write(plan, bell, plan->mapped[slot], data, seq, plan->trailer_mapped[slot]);
            if (pulled < 0) {
                return pulled == TT_WAIT_STOPPED ? TT_SEND_STOPPED : (int)UCS_ERR_TIMED_OUT;
            }
        } else {
            tt_copy_mapped(plan, plan->mapped[slot], data, plan->length);
        }
        if (!pulled) { /* (a receiver that pulled raised the flag itself, and is awake) */
            tt_write_mapped(NULL, NULL, 0, plan->trailer_mapped[slot], plan->trailer, 9);
            if (bell != NULL) {
                plan->rung += (uint64_t)tt_ring(&bell->doorbell);
            }
        }
        if (plan->mapped_writes != NULL) {
            __atomic_fetch_add(plan->mapped_writes, 1, __ATOMIC_RELAXED);
        }
        status = UCS_OK;
    } else {
        status = tt_put_flagged(plan->worker, plan->ep, data, plan->length, plan->remote[slot], plan->rkey[slot],
                                plan->trailer, 9, plan->trailer_remote[slot], plan->trailer_rkey[slot],
                                plan->flush_between, plan->timeout_ns, stop, failed);
    }
    return status;
}

/* One counter a peer reads (a receiver's credit towards its sender), written through a plan made once: the
   local copy, and the peer's word, mapped here or reached with a put. */
typedef struct {
    ucp_worker_h worker;
    ucp_ep_h ep;
    uint64_t *local;
    uint64_t remote;
    ucp_rkey_h rkey;
    uint64_t *mapped;
    /* the waits of tt_set_counter_planned: how long a put may take, the device's stop word, the endpoint's error
       slot; the device's count of writes into mapped memory, or NULL */
    int64_t timeout_ns;
    volatile int *stop;
    volatile int *failed;
    uint64_t *mapped_writes;
} tt_counter_plan;

/* Set the counter to `value`: here, then at the peer (one aligned 8-byte store where it is mapped here, else a
   put and a flush). */
static ucs_status_t tt_set_counter(tt_counter_plan *plan, uint64_t value, int64_t timeout_ns, volatile int *stop,
                                   volatile int *failed)
{
    *plan->local = value;
    if (plan->mapped != NULL) {
        __atomic_store_n(plan->mapped, value, __ATOMIC_RELEASE);
        if (plan->mapped_writes != NULL) {
            __atomic_fetch_add(plan->mapped_writes, 1, __ATOMIC_RELAXED);
        }
        return UCS_OK;
    }
    return tt_put_flagged(plan->worker, plan->ep, plan->local, sizeof(value), plan->remote, plan->rkey, NULL, 0, 0,
                          NULL, 0, timeout_ns, stop, failed);
}

/* tt_set_counter with the plan's own waits: a persistent receive's grant in one call */
static ucs_status_t tt_set_counter_planned(tt_counter_plan *plan, uint64_t value)
{
    return tt_set_counter(plan, value, plan->timeout_ns, plan->stop, plan->failed);
}

#define TT_MAX_LANES 16
/* chunks of a write spread over lanes start on this boundary */
#define TT_LANE_ALIGN 4096

/* One transfer whose data is spread over several endpoints (lanes, the paper's queue pairs per peer):
   chunk i goes over eps[i] (with rkeys[i], the key unpacked on that endpoint), all lanes are flushed,
   progressing every lane's worker from this thread, then the trailer goes over eps[0]. */
static ucs_status_t tt_put_flagged_lanes(ucp_worker_h *workers, ucp_ep_h *eps, ucp_rkey_h *rkeys, int lanes,
                                         const void *data, size_t length, uint64_t remote, const void *trailer,
                                         size_t trailer_length, uint64_t trailer_remote, ucp_rkey_h trailer_rkey,
                                         int64_t timeout_ns, volatile int *stop, volatile int *failed)
{
    int64_t deadline = tt_now_ns() + timeout_ns;
    ucs_status_ptr_t flushes[TT_MAX_LANES];
    ucs_status_t status = UCS_OK;
    size_t chunk, offset;
    int i, used = 0, busy;
    unsigned idle = 0, events;
    tt_cuda_enter();
    if (lanes < 1 || lanes > TT_MAX_LANES) {
        return UCS_ERR_INVALID_PARAM;
    }
    chunk = (length + lanes - 1) / lanes;
    chunk = (chunk + TT_LANE_ALIGN - 1) / TT_LANE_ALIGN * TT_LANE_ALIGN;
    for (i = 0, offset = 0; i < lanes && offset < length; i++, offset += chunk) {
        size_t part = length - offset < chunk ? length - offset : chunk;
        ucs_status_ptr_t put = tt_put(eps[i], (const char *)data + offset, part, remote + offset, rkeys[i]);
        if (UCS_PTR_IS_ERR(put)) {
            status = UCS_PTR_STATUS(put);
            break;
        }
        if (put != NULL) {
            ucp_request_free(put);
        }
        used = i + 1;
    }
    for (i = 0; i < used; i++) {
        flushes[i] = tt_ep_flush(eps[i]);
        if (UCS_PTR_IS_ERR(flushes[i])) {
            if (status == UCS_OK) {
                status = UCS_PTR_STATUS(flushes[i]);
            }
            flushes[i] = NULL;
        }
    }
    for (;;) {
        busy = 0;
        for (i = 0; i < used; i++) {
            if (flushes[i] == NULL) {
                continue;
            }
            ucs_status_t done = ucp_request_check_status(flushes[i]);
            if (done == UCS_INPROGRESS) {
                busy = 1;
                continue;
            }
            ucp_request_free(flushes[i]);
            flushes[i] = NULL;
            if (done != UCS_OK && status == UCS_OK) {
                status = done;
            }
        }
        if (!busy) {
            break;
        }
        if (*failed || *stop || tt_now_ns() > deadline) {
            for (i = 0; i < used; i++) {
                if (flushes[i] != NULL) {
                    ucp_request_free(flushes[i]);
                }
            }
            return *failed ? (ucs_status_t)*failed : UCS_ERR_TIMED_OUT;
        }
        events = 0;
        for (i = 0; i < used; i++) {
            if (i == 0 || workers[i] != workers[i - 1]) {
                events += ucp_worker_progress(workers[i]);
            }
        }
        idle = events ? 0 : idle + 1;
        if (idle >= TT_YIELD_AFTER) {
            sched_yield();
            idle = 0;
        }
    }
    if (status == UCS_OK && trailer_length) {
        status = tt_put_flushed(workers[0], eps[0], trailer, trailer_length, trailer_remote, trailer_rkey, deadline,
                                stop, failed);
    }
    return status;
}

/* A one-sided read, waited for from this thread. */
static ucs_status_t tt_get_sync(ucp_worker_h worker, ucp_ep_h ep, void *buffer, size_t length, uint64_t remote,
                                ucp_rkey_h rkey, int64_t timeout_ns, volatile int *stop, volatile int *failed)
{
    return tt_finish(worker, tt_get(ep, buffer, length, remote, rkey), tt_now_ns() + timeout_ns, stop, failed);
}

/* Progress the device's workers from a waiting thread: over tcp a peer's write lands only when this side's
   worker progresses, and doing it here saves waking the progress thread (thread mode is MULTI). */
static void tt_progress_all(ucp_worker_h *workers, int nworkers)
{
    int i;
    tt_cuda_enter();
    for (i = 0; i < nworkers; i++) {
        ucp_worker_progress(workers[i]);
    }
}

/* the most workers a waiter sleeps on at once (more: it naps without a wake-up source) */
#define TT_MAX_WORKERS 16

/* Arm `workers` for a sleep on their event descriptors, filled into `fds`: 1 once every one is armed (an
   event arriving from now on makes its descriptor readable), 0 if one had events pending (the caller
   progresses and looks again), -1 where they cannot be slept on (the caller naps). */
static int tt_arm(ucp_worker_h *workers, int nworkers, struct pollfd *fds)
{
    int i;
    tt_cuda_enter();
    if (nworkers > TT_MAX_WORKERS) {
        return -1;
    }
    for (i = 0; i < nworkers; i++) {
        ucs_status_t status = ucp_worker_arm(workers[i]);
        if (status == UCS_ERR_BUSY) {
            return 0;
        }
        if (status != UCS_OK || ucp_worker_get_efd(workers[i], &fds[i].fd) != UCS_OK) {
            return -1;
        }
        fds[i].events = POLLIN;
    }
    return 1;
}

/* Sleep up to `ns` on `count` armed workers' descriptors: over tcp a peer's write arriving ends it at once (into
   mapped memory a write raises no event, and this is a nap; so it is with no descriptors). */
static void tt_sleep_on(struct pollfd *fds, int count, int64_t ns)
{
    struct timespec timeout = {ns / 1000000000, ns % 1000000000};
    ppoll(fds, (nfds_t)count, &timeout, NULL);
}

/* Waiting for memory a peer writes: spin (yielding the core) for `spin_ns`, then sleep with growing timeouts on
   the workers' event descriptors, so that over tcp a peer's write wakes the sleeper as it arrives; or, with a
   `doorbell` (not NULL: a peer that writes into memory it maps rings it, tt_ring), on that. Without one, a
   write into mapped memory raises no event: there the sleeps are naps. `ready` returns a non-negative answer
   when done, -1 while not; it is looked at once more after arming, or after the doorbell's word is set, so a
   write that lands meanwhile is not slept through. */
#define TT_WAIT(ready_expression, doorbell)                                              \
    do {                                                                                 \
        int64_t start = tt_now_ns(), now = start, nap = TT_FIRST_NAP_NS;                 \
        int found, armed;                                                                \
        struct pollfd fds[TT_MAX_WORKERS];                                               \
        for (;;) {                                                                       \
            found = (ready_expression);                                                  \
            if (found >= 0) {                                                            \
                __atomic_thread_fence(__ATOMIC_ACQUIRE); /* what the flag guards, after */ \
                return found;                                                            \
            }                                                                            \
            tt_progress_all(workers, nworkers);                                          \
            if (*stop) {                                                                 \
                return TT_WAIT_STOPPED;                                                  \
            }                                                                            \
            now = tt_now_ns();                                                           \
            if (now - start > timeout_ns) {                                              \
                return TT_WAIT_TIMED_OUT;                                                \
            }                                                                            \
            if (now - start < spin_ns) {                                                 \
                int64_t watched = now + TT_WATCH_NS;                                     \
                while ((found = (ready_expression)) < 0 && tt_now_ns() < watched) {      \
                    tt_relax();                                                          \
                }                                                                        \
                if (found >= 0) {                                                        \
                    __atomic_thread_fence(__ATOMIC_ACQUIRE);                             \
                    return found;                                                        \
                }                                                                        \
                sched_yield();                                                           \
                continue;                                                                \
            }                                                                            \
            if ((doorbell) != NULL) {                                                    \
                __atomic_store_n((doorbell), 1, __ATOMIC_SEQ_CST);                       \
                if ((found = (ready_expression)) < 0) {                                  \
                    tt_doze((doorbell), nap);                                            \
                }                                                                        \
                __atomic_store_n((doorbell), 0, __ATOMIC_RELAXED);                       \
            } else {                                                                     \
                armed = tt_arm(workers, nworkers, fds);                                  \
                if (armed == 0) {                                                        \
                    continue; /* events pending: progress them first */                 \
                }                                                                        \
                if ((found = (ready_expression)) < 0) {                                  \
                    tt_sleep_on(fds, armed > 0 ? nworkers : 0, nap); /* none armed: a nap */ \
                }                                                                        \
            }                                                                            \
            if (found >= 0) {                                                            \
                __atomic_thread_fence(__ATOMIC_ACQUIRE);                                 \
                return found;                                                            \
            }                                                                            \
            nap *= 2;                                                                    \
            if (nap > (now - start < TT_PATIENT_NS ? TT_SHORT_NAP_NS : TT_LONG_NAP_NS)) { \
                nap = now - start < TT_PATIENT_NS ? TT_SHORT_NAP_NS : TT_LONG_NAP_NS;     \
            }                                                                            \
        }                                                                                \
    } while (0)

static int tt_first_raised(uint8_t **flags, uint8_t *done, int count)
{
    int i;
    for (i = 0; i < count; i++) {
        if (!done[i] && *(volatile uint8_t *)flags[i]) {
            return i;
        }
    }
    return -1;
}

/* The index of a flag byte not yet `done` that is raised (non-zero), or TT_WAIT_* */
static int tt_wait_flags(uint8_t **flags, uint8_t *done, int count, int64_t spin_ns, int64_t timeout_ns,
                         volatile int *stop, ucp_worker_h *workers, int nworkers)
{
    TT_WAIT(tt_first_raised(flags, done, count), (volatile uint32_t *)NULL);
}

/* 1 once the counter at `word` exceeds `above`, or TT_WAIT_* */
static int tt_wait_counter(uint64_t *word, uint64_t above, int64_t spin_ns, int64_t timeout_ns,
                           volatile int *stop, ucp_worker_h *workers, int nworkers)
{
    TT_WAIT(*(volatile uint64_t *)word > above ? 1 : -1, (volatile uint32_t *)NULL);
}

static int tt_first_above(uint64_t **words, uint64_t *above, int count)
{
    int i;
    for (i = 0; i < count; i++) {
        if (*(volatile uint64_t *)words[i] > above[i]) {
            return i;
        }
    }
    return -1;
}

/* The index of a counter that exceeds its threshold, or TT_WAIT_* */
static int tt_wait_counters(uint64_t **words, uint64_t *above, int count, int64_t spin_ns, int64_t timeout_ns,
                            volatile int *stop, ucp_worker_h *workers, int nworkers)
{
    TT_WAIT(tt_first_above(words, above, count), (volatile uint32_t *)NULL);
}

/* A static tensor's receives, taken through a plan made once: each slot's trailer (step, then the flag byte)
   in this process's memory, where the sender writes it, and how its waits go (as a send plan's). */
typedef struct {
    int slots;
    uint8_t *trailer[TT_MAX_SLOTS];
    /* each slot's bell (tt_bell), or NULL; while `bells` is set (the sender maps this memory) a wait sleeps on
       its doorbell past the spin, else on the workers, and serves the sender's pulls into the slot (`slot`,
       `length` bytes), where it has one (slots of TT_PULL_FROM bytes or more: a smaller one is never asked, and
       its takes touch nothing of the bell's but the doorbell) */
    tt_bell *bell[TT_MAX_SLOTS];
    volatile int bells;
    void *slot[TT_MAX_SLOTS];
    size_t length;
    /* the pulls served; this process */
    uint64_t pulls;
    uint32_t pid;
    int64_t spin_ns;
    volatile int *stop;
    ucp_worker_h *workers;
    int nworkers;
    /* the trailer last taken: its flag and step */
    int flag;
    int64_t step;
} tt_take_plan;

/* Serve the pull asked in `bell` (see tt_bell): take it up (unless the sender withdrew it), read the sender's
   `length` bytes into `slot`, raise the slot's flag `flag` to `raised` (the sender wrote the step before it asked,
   and writes no trailer after a pull: one crossing of the cores less), and say it is done (or failed: this process
   may not read the sender's memory; then the sender writes the data and the trailer). */
static void tt_serve_pull(tt_take_plan *plan, tt_bell *bell, uint64_t asked, void *slot, uint8_t *flag,
                          uint8_t raised)
{
    uint64_t word = asked;
    size_t done = 0;
    struct iovec local, remote;
    ssize_t got;
    if (!__atomic_compare_exchange_n(&bell->pull, &word, asked + (TT_PULL_TAKEN - TT_PULL_ASKED), 0,
                                     __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        return;
    }
    while (done < plan->length) {
        local.iov_base = (uint8_t *)slot + done;
        local.iov_len = plan->length - done;
        remote.iov_base = (void *)(uintptr_t)(bell->source + done);
        remote.iov_len = plan->length - done;
        got = process_vm_readv((pid_t)bell->giver, &local, 1, &remote, 1, 0);
        if (got <= 0) {
            break;
        }
        done += (size_t)got;
    }
    plan->pulls += done == plan->length;
    if (done == plan->length) {
        __atomic_store_n(flag, raised, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&bell->pull, asked + ((done == plan->length ? TT_PULL_DONE : TT_PULL_FAILED) - TT_PULL_ASKED),
                     __ATOMIC_RELEASE);
}

/* 0 once the flag byte `flag` is raised, else -1, serving a pull asked meanwhile (`bell` not NULL), which raises
   it to `raised` */
static int tt_take_ready(tt_take_plan *plan, uint8_t *flag, tt_bell *bell, uint64_t asked, void *slot,
                         uint8_t raised)
{
    if (*(volatile uint8_t *)flag) {
        return 0;
    }
    if (bell != NULL && __atomic_load_n(&bell->pull, __ATOMIC_ACQUIRE) == asked) {
        tt_serve_pull(plan, bell, asked, slot, flag, raised);
        return *(volatile uint8_t *)flag ? 0 : -1;
    }
    return -1;
}

/* Wait for transfer `seq`'s flag byte in slot `slot` (0 when raised); past the spin, sleep on the slot's doorbell
   where the plan has bells on; serve pulls of it where the plan can (bells on, a slot to pull into); TT_WAIT_* */
static int tt_wait_rung(tt_take_plan *plan, int slot, uint64_t seq, int64_t timeout_ns)
{
    uint8_t *flag = plan->trailer[slot] + 8;
    tt_bell *bell = plan->bells ? plan->bell[slot] : NULL;
    volatile uint32_t *doorbell = bell != NULL ? &bell->doorbell : NULL;
    tt_bell *pulls = bell != NULL && plan->slot[slot] != NULL ? bell : NULL;
    uint64_t asked = tt_pull_word(seq, TT_PULL_ASKED);
    uint8_t raised = (uint8_t)(1 + seq % 255);
    int64_t spin_ns = plan->spin_ns;
    volatile int *stop = plan->stop;
    ucp_worker_h *workers = plan->workers;
    int nworkers = plan->nworkers;
    TT_WAIT(tt_take_ready(plan, flag, pulls, asked, plan->slot[slot], raised), doorbell);
}

#define TT_TAKEN 1
#define TT_TAKEN_OTHER 0

/* Take transfer `seq`: wait for the flag of its slot (seq % slots), then lower it, keeping the flag and the step
   written before it in plan->flag and plan->step. TT_TAKEN: they are transfer seq's flag (1 + seq % 255) and
   `step`; TT_TAKEN_OTHER: they are not (the caller says what came); or TT_WAIT_* */
static int tt_take_planned(tt_take_plan *plan, uint64_t seq, int64_t step, int64_t timeout_ns)
{
    int slot = (int)(seq % (uint64_t)plan->slots);
    uint8_t *trailer = plan->trailer[slot];
    uint8_t *flag = trailer + 8;
    tt_bell *bell = plan->bells && plan->slot[slot] != NULL ? plan->bell[slot] : NULL;
    int found;
    if (bell != NULL) { /* a sender that finds this asks for a pull (see tt_bell) */
        bell->taker = plan->pid;
        __atomic_store_n(&bell->waiting, seq + 1, __ATOMIC_SEQ_CST);
    }
    found = tt_wait_rung(plan, slot, seq, timeout_ns);
    if (bell != NULL) {
        __atomic_store_n(&bell->waiting, 0, __ATOMIC_SEQ_CST);
    }
    if (found < 0) {
        return found;
    }
    plan->flag = *(volatile uint8_t *)flag;
    memcpy(&plan->step, trailer, sizeof(plan->step));
    *(volatile uint8_t *)flag = 0;
    return plan->flag == (int)(1 + seq % 255) && plan->step == step ? TT_TAKEN : TT_TAKEN_OTHER;
}

static int tt_is_request(ucs_status_ptr_t ptr)
{
    return UCS_PTR_IS_PTR(ptr);
}

static ucs_status_t tt_status(ucs_status_ptr_t ptr)
{
    return UCS_PTR_STATUS(ptr);
}

#ifndef TT_BUILT_AGAINST
#error "build.py defines TT_BUILT_AGAINST (libucx-cu12, or the system UCX's directory) before including shim.c"
#endif

/* where the UCX this binding was compiled against comes from */
static const char *tt_built_against(void)
{
    return TT_BUILT_AGAINST;
}

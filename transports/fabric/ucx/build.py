"""Builds the cffi binding (API mode) of the UCP calls the ``ucx`` fabric uses.

Run at install time by ``setup.py``; a user never compiles by hand. Headers and
libraries come from the PyPI wheel ``libucx-cu12`` (no GPU needed), or from the
UCX installed under ``$TENSOR_BENCH_UCX_HOME`` when that is set (say, a cluster's
UCX built with verbs, for real RDMA with the same code).

A small C shim hides UCX's parameter structs and unions: Python sees plain
functions. Completion is observed by polling request status, never by calling
back into Python from UCX.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

UCX_HOME_VARIABLE = "TENSOR_BENCH_UCX_HOME"  # the same name as device.UCX_HOME_VARIABLE

CDEF = """
typedef int ucs_status_t;
typedef void *ucs_status_ptr_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey *ucp_rkey_h;
typedef struct ucp_address ucp_address_t;

#define UCS_OK ...
#define UCS_INPROGRESS ...
#define UCS_ERR_BUSY ...

const char *ucs_status_string(ucs_status_t status);
const char *ucp_get_version_string(void);

ucs_status_t tt_init(const char *tls, char **names, char **values, int count, ucp_context_h *context);
ucs_status_t tt_config_accepts(const char *name, const char *value);
void ucp_cleanup(ucp_context_h context);

ucs_status_t tt_worker_create(ucp_context_h context, ucp_worker_h *worker);
ucs_status_ptr_t tt_doorbell(ucp_ep_h ep);
void ucp_worker_destroy(ucp_worker_h worker);
ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t **address, size_t *length);
void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address);
unsigned ucp_worker_progress(ucp_worker_h worker);
unsigned long tt_progress_burst(ucp_worker_h worker, unsigned idle_rounds);
ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int *fd);
ucs_status_t ucp_worker_arm(ucp_worker_h worker);
ucs_status_t ucp_worker_signal(ucp_worker_h worker);

ucs_status_t tt_ep_create(ucp_worker_h worker, const void *address, int peer_errors, int *error_slot, ucp_ep_h *ep);
ucs_status_ptr_t tt_ep_close(ucp_ep_h ep, int force);
ucs_status_ptr_t tt_ep_flush(ucp_ep_h ep);
char *tt_ep_info(ucp_ep_h ep);
void free(void *ptr);

ucs_status_t tt_mem_map(ucp_context_h context, void *address, size_t length, ucp_mem_h *memh);
void *tt_mem_address(ucp_mem_h memh, size_t *length);
ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh);
ucs_status_t ucp_rkey_pack(ucp_context_h context, ucp_mem_h memh, void **rkey_buffer, size_t *size);
void ucp_rkey_buffer_release(void *rkey_buffer);
ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h *rkey);
void ucp_rkey_destroy(ucp_rkey_h rkey);
ucs_status_t ucp_rkey_ptr(ucp_rkey_h rkey, uint64_t raddr, void **addr_p);

ucs_status_ptr_t tt_put(ucp_ep_h ep, const void *buffer, size_t length, uint64_t remote_addr, ucp_rkey_h rkey);
ucs_status_ptr_t tt_get(ucp_ep_h ep, void *buffer, size_t length, uint64_t remote_addr, ucp_rkey_h rkey);
int tt_is_request(ucs_status_ptr_t ptr);
ucs_status_t tt_status(ucs_status_ptr_t ptr);
ucs_status_t ucp_request_check_status(void *request);
void ucp_request_free(void *request);
"""

SHIM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

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

#define TT_DOORBELL_AM 1

/* A doorbell carries nothing: its arrival wakes the target's progress thread, which is all
   it is for (the role a completion event of a verbs write-with-immediate plays). */
static ucs_status_t tt_on_doorbell(void *arg, const void *header, size_t header_length, void *data,
                                   size_t length, const ucp_am_recv_param_t *param)
{
    return UCS_OK;
}

static ucs_status_t tt_worker_create(ucp_context_h context, ucp_worker_h *worker)
{
    ucp_worker_params_t params;
    ucp_am_handler_param_t handler;
    ucs_status_t status;
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
    *(volatile int *)arg = (int)status;
}

/* peer_errors: ask UCX to detect and report a failed peer (not all shared-memory
   transports support it, so it is off for them) */
static ucs_status_t tt_ep_create(ucp_worker_h worker, const void *address, int peer_errors, int *error_slot,
                                 ucp_ep_h *ep)
{
    ucp_ep_params_t params;
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
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    return ucp_ep_close_nbx(ep, &param);
}

static ucs_status_ptr_t tt_ep_flush(ucp_ep_h ep)
{
    ucp_request_param_t param;
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
    param.op_attr_mask = 0;
    return ucp_put_nbx(ep, buffer, length, remote_addr, rkey, &param);
}

static ucs_status_ptr_t tt_get(ucp_ep_h ep, void *buffer, size_t length, uint64_t remote_addr,
                               ucp_rkey_h rkey)
{
    ucp_request_param_t param;
    param.op_attr_mask = 0;
    return ucp_get_nbx(ep, buffer, length, remote_addr, rkey, &param);
}

static int tt_is_request(ucs_status_ptr_t ptr)
{
    return UCS_PTR_IS_PTR(ptr);
}

static ucs_status_t tt_status(ucs_status_ptr_t ptr)
{
    return UCS_PTR_STATUS(ptr);
}
"""


def ucx_home() -> tuple[Path, bool]:
    """Where UCX's include/ and lib/ are, and whether it is a system install (not the wheel)."""
    if os.environ.get(UCX_HOME_VARIABLE):
        return Path(os.environ[UCX_HOME_VARIABLE]), True
    import libucx  # the PyPI wheel libucx-cu12

    return Path(libucx.__file__).parent, False


def make_ffibuilder() -> FFI:
    home, system = ucx_home()
    ffibuilder = FFI()
    ffibuilder.cdef(CDEF)
    ffibuilder.set_source(
        "transports.fabric.ucx._ucp",
        SHIM,
        include_dirs=[str(home / "include")],
        library_dirs=[str(home / "lib")],
        libraries=["ucp", "uct", "ucs"],
        # a system UCX is found through the rpath; the wheel's is loaded by libucx first
        extra_link_args=[f"-Wl,-rpath,{home / 'lib'}"] if system else [],
    )
    return ffibuilder


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

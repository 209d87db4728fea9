/* What Python sees of the UCX binding: cffi's cdef (read by build.py), not a header a C compiler reads.
 *
 * cffi parses this text itself, so it holds only declarations: no #include, #if or other preprocessor
 * lines except cffi's own "#define NAME ..." (the value is taken from the compiled UCX headers).
 * Functions named tt_* are the shim's (shim.c); the others are UCX's own, called directly. In API mode
 * cffi's generated code calls each with these types, so a mismatch with shim.c or UCX is a compiler
 * warning or error.
 */

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
#define UCS_ERR_TIMED_OUT ...
#define UCS_ERR_CONNECTION_RESET ...

const char *ucs_status_string(ucs_status_t status);
const char *ucp_get_version_string(void);

ucs_status_t tt_init(const char *tls, char **names, char **values, int count, ucp_context_h *context);
ucs_status_t tt_config_accepts(const char *name, const char *value);
int tt_offers_tl(const char *component, const char *name);
int tt_cuda_use(int device);
void tt_cuda_enter(void);
int tt_cuda_range(uintptr_t address, uintptr_t *base, size_t *size);
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

ucs_status_t tt_put_flagged(ucp_worker_h worker, ucp_ep_h ep, const void *data, size_t length, uint64_t remote,
                            ucp_rkey_h rkey, const void *trailer, size_t trailer_length, uint64_t trailer_remote,
                            ucp_rkey_h trailer_rkey, int flush_between, int64_t timeout_ns, volatile int *stop,
                            volatile int *failed);
ucs_status_t tt_put_flagged_lanes(ucp_worker_h *workers, ucp_ep_h *eps, ucp_rkey_h *rkeys, int lanes,
                                  const void *data, size_t length, uint64_t remote, const void *trailer,
                                  size_t trailer_length, uint64_t trailer_remote, ucp_rkey_h trailer_rkey,
                                  int64_t timeout_ns, volatile int *stop, volatile int *failed);
void tt_write_mapped(void *target, const void *data, size_t length, uint8_t *trailer_target,
                     const uint8_t *trailer, size_t trailer_length);
int tt_populate(void *address, size_t length);
#define TT_MAX_SLOTS ...
typedef struct {
    uint32_t doorbell;
    uint32_t giver;
    uint32_t taker;
    uint32_t unused;
    uint64_t waiting;
    uint64_t pull;
    uint64_t source;
} tt_bell;
#define TT_PULL_FROM ...
typedef struct {
    ucp_worker_h worker;
    ucp_ep_h ep;
    int slots;
    size_t length;
    uint64_t remote[2];
    ucp_rkey_h rkey[2];
    void *mapped[2];
    uint64_t trailer_remote[2];
    ucp_rkey_h trailer_rkey[2];
    uint8_t *trailer_mapped[2];
    uint8_t *trailer;
    uint64_t *posted;
    int64_t spin_ns;
    volatile int *stop;
    volatile int *failed;
    ucp_worker_h *workers;
    int nworkers;
    int64_t credit_wait_ns;
    int64_t timeout_ns;
    int streaming;
    unsigned since_timed;
    int64_t took_ns[2];
    tt_bell *bell[2];
    uint64_t rung;
    uint64_t pulled;
    int pulls_off;
    uint32_t pid;
    int pulling;
    unsigned since_pull_timed;
    int64_t pull_took_ns[2];
    uint64_t *mapped_writes;
    int flush_between;
} tt_send_plan;
#define TT_NO_CREDIT ...
#define TT_SEND_STOPPED ...
int tt_send_planned(tt_send_plan *plan, const void *data, uint64_t seq, int64_t step);
typedef struct {
    ucp_worker_h worker;
    ucp_ep_h ep;
    uint64_t *local;
    uint64_t remote;
    ucp_rkey_h rkey;
    uint64_t *mapped;
    int64_t timeout_ns;
    volatile int *stop;
    volatile int *failed;
    uint64_t *mapped_writes;
} tt_counter_plan;
ucs_status_t tt_set_counter(tt_counter_plan *plan, uint64_t value, int64_t timeout_ns, volatile int *stop,
                            volatile int *failed);
ucs_status_t tt_set_counter_planned(tt_counter_plan *plan, uint64_t value);
#define TT_MAX_LANES ...
ucs_status_t tt_get_sync(ucp_worker_h worker, ucp_ep_h ep, void *buffer, size_t length, uint64_t remote,
                         ucp_rkey_h rkey, int64_t timeout_ns, volatile int *stop, volatile int *failed);
int tt_wait_flags(uint8_t **flags, uint8_t *done, int count, int64_t spin_ns, int64_t timeout_ns,
                  volatile int *stop, ucp_worker_h *workers, int nworkers);
int tt_wait_counter(uint64_t *word, uint64_t above, int64_t spin_ns, int64_t timeout_ns, volatile int *stop,
                    ucp_worker_h *workers, int nworkers);
int tt_wait_counters(uint64_t **words, uint64_t *above, int count, int64_t spin_ns, int64_t timeout_ns,
                     volatile int *stop, ucp_worker_h *workers, int nworkers);
#define TT_WAIT_TIMED_OUT ...
#define TT_WAIT_STOPPED ...
typedef struct {
    int slots;
    uint8_t *trailer[2];
    tt_bell *bell[2];
    volatile int bells;
    void *slot[2];
    size_t length;
    uint64_t pulls;
    uint32_t pid;
    int64_t spin_ns;
    volatile int *stop;
    ucp_worker_h *workers;
    int nworkers;
    int flag;
    int64_t step;
} tt_take_plan;
#define TT_TAKEN ...
#define TT_TAKEN_OTHER ...
int tt_take_planned(tt_take_plan *plan, uint64_t seq, int64_t step, int64_t timeout_ns);
ucs_status_t tt_status(ucs_status_ptr_t ptr);
ucs_status_t ucp_request_check_status(void *request);
void ucp_request_free(void *request);
const char *tt_built_against(void);

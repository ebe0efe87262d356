/*
 * uzswap.h - the C API of uzswap's runtime (crate uzswap-capi; link with
 * -luzswap_capi, the cdylib, or libuzswap_capi.a plus -lpthread -ldl -lm).
 *
 * A runtime owns a memory budget, a compressed store, a reclaimer thread and a
 * userfaultfd. Regions created from it are ordinary anonymous memory to the
 * program; beyond the budget, their cold folios are compressed whole and come
 * back on the next touch, bit for bit. See crates/runtime/src/lib.rs for the
 * design and the trade-off between the two fault paths.
 *
 * Errors: functions returning a pointer return NULL, functions returning int
 * return -1; uzswap_last_error() then describes the error (per thread).
 * All functions are thread-safe.
 */
#ifndef UZSWAP_H
#define UZSWAP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct uzswap_runtime uzswap_runtime;

enum uzswap_fault_path {
    /* A handler thread resolves faults: works for system calls too (read(2)
     * into a region), about 35-70 us per fault. */
    UZSWAP_FAULT_THREAD = 0,
    /* The faulting thread resolves its own fault in a SIGBUS handler: several
     * times faster, but a system call touching a swapped-out page fails with
     * EFAULT. Installs a process-wide SIGBUS handler that chains to the
     * previous one for addresses it does not manage. */
    UZSWAP_FAULT_SIGBUS = 1,
};

enum uzswap_policy {
    /* Oldest first, through a probation step that catches hot folios (default). */
    UZSWAP_POLICY_PROBATION = 0,
    /* Oldest fault-in first, compressed at once. */
    UZSWAP_POLICY_FIFO = 1,
};

struct uzswap_config {
    uint64_t budget_bytes;  /* resident pages of all regions + the pool */
    int fault_path;         /* enum uzswap_fault_path */
    int policy;             /* enum uzswap_policy */
    int publish_stats;      /* nonzero: publish live stats for `uzswap stat PID` */
};

/* Fills *cfg with the defaults for a budget. */
void uzswap_config_default(struct uzswap_config *cfg, uint64_t budget_bytes);

/* Starts a runtime. NULL if userfaultfd is unavailable (the error says what is
 * missing) or the configuration is bad. */
uzswap_runtime *uzswap_runtime_new(const struct uzswap_config *cfg);

/* As uzswap_runtime_new, with settings given as a config file's "key = value"
 * lines (the names `uzswap run --help` lists, e.g. "writeback = redis://host:6379\n
 * writeback_dir = /var/tmp\n"), which win over *cfg. NULL settings: none. A bad
 * setting, or a remote store that cannot be reached, is an error here. */
uzswap_runtime *uzswap_runtime_new_with(const struct uzswap_config *cfg, const char *settings);

/* Destroys every region still alive, then stops the runtime. NULL is a no-op. */
void uzswap_runtime_free(uzswap_runtime *rt);

/* Maps a managed region of len bytes (rounded up to whole folios), aligned to
 * folio_size, a power of two from 4096 to 2 MiB. Never-written memory reads as
 * zeros. The region is MADV_DONTFORK: a child process does not inherit it.
 * Returns its address, or NULL. */
void *uzswap_region_create(uzswap_runtime *rt, size_t len, size_t folio_size);

/* Unmaps a region (by its address) and frees what it held in every tier.
 * Returns 0, or -1 if addr is not a region of rt. */
int uzswap_region_destroy(uzswap_runtime *rt, void *addr);

/* Bytes counted against the budget now. */
uint64_t uzswap_usage(uzswap_runtime *rt);

/* Writes the live stats as a JSON object (NUL-terminated) into buf. Returns
 * the length of the JSON text; if that is >= len, the text was cut short and a
 * buffer of the returned length + 1 is needed. */
size_t uzswap_stats_json(uzswap_runtime *rt, char *buf, size_t len);

/* The last error on this thread, or "" if none. Valid until the next call. */
const char *uzswap_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* UZSWAP_H */

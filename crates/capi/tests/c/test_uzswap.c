/* Uses the C API as a C program would: a region four times its budget, written and
 * verified bit for bit through both fault paths. Exit 0: pass; 77: skipped
 * (userfaultfd unavailable); anything else: failure. */
#include "uzswap.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB (1024u * 1024u)

static uint64_t word(size_t page, size_t w) {
    /* Compressible: 8 distinct words per page, the rest a constant. */
    return w < 8 ? (page * 0x9E3779B97F4A7C15ull) ^ w : 0xC0FFEEull;
}

/* settings: NULL, or config lines for uzswap_runtime_new_with (remote: they name a
 * redis-server, and the run must have read back from it). */
static int run(int fault_path, const char *settings) {
    struct uzswap_config cfg;
    uzswap_config_default(&cfg, 8 * MIB);
    cfg.fault_path = fault_path;
    cfg.publish_stats = 0;
    uzswap_runtime *rt = settings ? uzswap_runtime_new_with(&cfg, settings) : uzswap_runtime_new(&cfg);
    if (!rt) {
        printf("SKIP: %s\n", uzswap_last_error());
        return 77;
    }
    if (uzswap_region_create(rt, MIB, 3000) != NULL || strstr(uzswap_last_error(), "folio size") == NULL) {
        fprintf(stderr, "a bad folio size must fail with a message, got '%s'\n", uzswap_last_error());
        return 1;
    }
    size_t len = 32 * MIB, pages = len / 4096, words = 4096 / 8;
    uint64_t *p = uzswap_region_create(rt, len, 64 * 1024);
    if (!p) {
        fprintf(stderr, "region: %s\n", uzswap_last_error());
        return 1;
    }
    for (size_t i = 0; i < pages; i++)
        for (size_t w = 0; w < words; w++) p[i * words + w] = word(i, w);
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < pages; i++)
            for (size_t w = 0; w < words; w++)
                if (p[i * words + w] != word(i, w)) {
                    fprintf(stderr, "page %zu word %zu differs\n", i, w);
                    return 1;
                }
    if (uzswap_usage(rt) > 12 * MIB) {
        fprintf(stderr, "usage %llu far over the budget\n", (unsigned long long)uzswap_usage(rt));
        return 1;
    }
    char json[8192];
    size_t n = uzswap_stats_json(rt, json, sizeof json);
    if (n == 0 || n >= sizeof json || strstr(json, "\"hugepages-64kB\"") == NULL || strstr(json, "\"zswpin\"") == NULL) {
        fprintf(stderr, "stats json (%zu bytes): %s\n", n, json);
        return 1;
    }
    if (settings && (strstr(json, "\"remote_records_read\"") == NULL || strstr(json, "\"remote_records_read\":0,") != NULL)) {
        fprintf(stderr, "nothing read back from the remote store: %s\n", json);
        return 1;
    }
    if (uzswap_region_destroy(rt, p) != 0 || uzswap_region_destroy(rt, p) != -1) {
        fprintf(stderr, "destroy: %s\n", uzswap_last_error());
        return 1;
    }
    /* A region left alive is destroyed by uzswap_runtime_free. */
    if (!uzswap_region_create(rt, 4 * MIB, 4096)) return 1;
    uzswap_runtime_free(rt);
    printf("fault path %d%s: ok\n", fault_path, settings ? " (remote)" : "");
    return 0;
}

int main(void) {
    int rc = run(UZSWAP_FAULT_THREAD, NULL);
    if (rc) return rc;
    rc = run(UZSWAP_FAULT_SIGBUS, NULL);
    if (rc) return rc;
    /* Settings by name: a bad one is an error that says why. */
    struct uzswap_config cfg;
    uzswap_config_default(&cfg, 8 * MIB);
    if (uzswap_runtime_new_with(&cfg, "writeback = redis://nowhere\n") != NULL || strstr(uzswap_last_error(), "host:port") == NULL) {
        fprintf(stderr, "a bad writeback URL must fail with a message, got '%s'\n", uzswap_last_error());
        return 1;
    }
    /* A redis-server the harness started: written back there, and read back. */
    const char *url = getenv("UZSWAP_TEST_REDIS");
    if (url) {
        char settings[512];
        snprintf(settings, sizeof settings, "writeback = %s\nwriteback_dir = none\nmax_pool_percent = 1\n", url);
        for (int path = UZSWAP_FAULT_THREAD; path <= UZSWAP_FAULT_SIGBUS; path++)
            if ((rc = run(path, settings))) return rc;
    }
    return 0;
}

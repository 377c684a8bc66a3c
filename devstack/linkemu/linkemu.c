/* linkemu: userspace WAN link emulator joining two TUN devices (IFF_TUN|IFF_NO_PI).
 *
 * Each direction (a->b, b->a) runs in its own thread and emulates, in this order:
 *   random loss (seeded xorshift64*), drop-tail queue (bytes and/or packets waiting
 *   for serialization), rate limit (serialization delay: a packet of L bytes
 *   occupies the link for L*8/rate seconds), then a fixed one-way propagation delay.
 * Packets wait in a FIFO delay line (byte arena + descriptor ring) and are written
 * to the other TUN when due (CLOCK_MONOTONIC, ppoll with ns timeouts).
 * Rate and queue count IP bytes (what TUN carries; no L2 framing).
 *
 * Prints "ready tun_a=... tun_b=..." on stdout once both devices exist, the counters
 * on SIGUSR1 (keeps running) and on SIGINT/SIGTERM (then exits). Flags apply to both directions; append -ab or -ba to
 * a flag (e.g. --rate-mbit-ba 50) to set one direction only.
 *
 * SIGRTMIN cuts the link: until SIGRTMIN+1 restores it, every packet is dropped both ways,
 * arriving ones and those already in the delay line (counted in drop_cut), as when a fibre
 * is cut; no ICMP, no RST, nothing reaches either side.
 * SIGRTMIN+2 slows the link to 1/10 of its rate (both ways; queues keep their size in bytes),
 * SIGRTMIN+3 gives it its rate back: a path that degrades under a running workload.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MAXPKT 65536
#define BATCH 64

typedef struct { uint64_t off, len, due, gen; } desc_t;  /* gen: the cut count when it arrived */

typedef struct {
    const char *name;                /* "a->b" */
    int in_fd, out_fd;
    double delay_ms, rate_mbit, loss_pct;
    long long queue_bytes, queue_pkts; /* <0: default */
    uint64_t rng;
    /* delay line */
    uint8_t *arena; uint64_t arena_sz, a_head, a_tail; /* byte offsets, monotonically growing */
    desc_t *ring; uint64_t ring_sz, r_head, r_tail;
    uint64_t delay_ns, link_free_ns; /* link_free_ns: serializer done with last accepted packet */
    uint64_t qpkts_tail;             /* ring index of first packet still being serialized */
    int was_slow;                    /* the rate the schedule was made at (this thread's view of `slow`) */
    /* counters */
    uint64_t rx_pkts, rx_bytes, tx_pkts, tx_bytes, drop_loss, drop_queue, drop_buf, drop_cut, tx_err;
    uint64_t late_sum_ns, late_max_ns, late_1ms; /* release time minus due time */
} dir_t;

static volatile sig_atomic_t stop;
static volatile int cut;  /* SIGRTMIN sets, SIGRTMIN+1 clears: every packet is dropped meanwhile */
static volatile uint64_t cuts;  /* cuts so far: a packet in the delay line across a cut is dropped at release */
static volatile int slow; /* SIGRTMIN+2 sets, SIGRTMIN+3 clears: the rate is divided by SLOW_FACTOR */
#define SLOW_FACTOR 10.0
static uint64_t arena_mb = 64, ring_slots = 1 << 18;
static int arena_given, ring_given;  /* --arena-mb given: else each direction's arena is sized to hold its delay line */

static uint64_t now_ns(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static double rnd(uint64_t *s) {  /* xorshift64*, uniform in [0,1) */
    *s ^= *s >> 12; *s ^= *s << 25; *s ^= *s >> 27;
    return ((*s * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

static int tun_open(const char *name) {
    struct ifreq ifr; int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC);
    if (fd < 0) { perror("open /dev/net/tun"); exit(1); }
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) { fprintf(stderr, "TUNSETIFF %s: %s\n", name, strerror(errno)); exit(1); }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

/* Accept one packet of len bytes (already in buf) at time t. */
static void enqueue(dir_t *d, const uint8_t *buf, uint64_t len, uint64_t t) {
    d->rx_pkts++; d->rx_bytes += len;
    if (__atomic_load_n(&cut, __ATOMIC_RELAXED)) { d->drop_cut++; return; }
    if (d->loss_pct > 0 && rnd(&d->rng) * 100.0 < d->loss_pct) { d->drop_loss++; return; }
    uint64_t start = d->link_free_ns > t ? d->link_free_ns : t;
    double rate = d->rate_mbit / (d->was_slow ? SLOW_FACTOR : 1.0);
    if (rate > 0) {
        /* backlog = bytes still waiting for (or in) serialization */
        uint64_t backlog = (uint64_t)((start - t) * rate / 8000.0);
        if (d->qpkts_tail < d->r_tail) d->qpkts_tail = d->r_tail;
        while (d->qpkts_tail < d->r_head && d->ring[d->qpkts_tail % d->ring_sz].due
               - d->delay_ns <= t) d->qpkts_tail++;
        uint64_t qp = d->r_head - d->qpkts_tail;
        if ((d->queue_bytes > 0 && backlog + len > (uint64_t)d->queue_bytes) ||
            (d->queue_pkts > 0 && qp + 1 > (uint64_t)d->queue_pkts)) { d->drop_queue++; return; }
        start += (uint64_t)(len * 8000.0 / rate);
    }
    /* reserve contiguous arena space; skip the end of the arena if the packet won't fit */
    uint64_t pos = d->a_head % d->arena_sz, skip = (pos + len > d->arena_sz) ? d->arena_sz - pos : 0;
    if (d->r_head - d->r_tail >= d->ring_sz || d->a_head + skip + len - d->a_tail > d->arena_sz) {
        d->drop_buf++; return;
    }
    d->a_head += skip; pos = d->a_head % d->arena_sz;
    memcpy(d->arena + pos, buf, len);
    desc_t *e = &d->ring[d->r_head % d->ring_sz];
    e->off = d->a_head; e->len = len; e->due = start + d->delay_ns;
    e->gen = __atomic_load_n(&cuts, __ATOMIC_RELAXED);
    d->a_head += len; d->r_head++;
    d->link_free_ns = start;
}

/* The rate changed (slow / unslow) at t: the packets still waiting for the serializer, and the serializer's
 * own end, are rescheduled at the new rate (ratio: old rate / new rate); those already serialized keep their
 * due time. Without this a queue built at 1/10 of the rate drained at it after the rate came back, and its
 * backlog, read at the new rate, looked 10x fuller: nearly every new packet was dropped. */
static void rescale(dir_t *d, uint64_t t, double ratio) {
    if (d->link_free_ns > t) d->link_free_ns = t + (uint64_t)((double)(d->link_free_ns - t) * ratio);
    for (uint64_t i = d->qpkts_tail > d->r_tail ? d->qpkts_tail : d->r_tail; i < d->r_head; i++) {
        desc_t *e = &d->ring[i % d->ring_sz];
        uint64_t end = e->due - d->delay_ns;       /* its serialization's end */
        if (end > t) e->due = t + (uint64_t)((double)(end - t) * ratio) + d->delay_ns;
    }
}

static void *run_dir(void *arg) {
    dir_t *d = arg;
    static __thread uint8_t buf[MAXPKT];
    struct pollfd pfd = { .fd = d->in_fd, .events = POLLIN };
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    while (!stop) {
        uint64_t t = now_ns();
        int s = __atomic_load_n(&slow, __ATOMIC_RELAXED);
        if (s != d->was_slow) {
            if (d->rate_mbit > 0) rescale(d, t, s ? SLOW_FACTOR : 1.0 / SLOW_FACTOR);
            d->was_slow = s;
        }
        while (d->r_tail < d->r_head) {            /* release due packets */
            desc_t *e = &d->ring[d->r_tail % d->ring_sz];
            if (e->due > t) break;
            uint64_t late = t - e->due;
            d->late_sum_ns += late; d->late_1ms += late > 1000000;
            if (late > d->late_max_ns) d->late_max_ns = late;
            if (__atomic_load_n(&cut, __ATOMIC_RELAXED) || e->gen != __atomic_load_n(&cuts, __ATOMIC_RELAXED))
                d->drop_cut++;  /* on the wire when it was cut (even if restored since) */
            else if (write(d->out_fd, d->arena + e->off % d->arena_sz, e->len) < 0) d->tx_err++;
            else { d->tx_pkts++; d->tx_bytes += e->len; }
            d->a_tail = e->off + e->len; d->r_tail++;
        }
        uint64_t wait = 50000000;                  /* 50 ms max so that stop is noticed */
        if (d->r_tail < d->r_head) {
            uint64_t due = d->ring[d->r_tail % d->ring_sz].due;
            wait = due > t ? due - t : 0;
            if (wait > 50000000) wait = 50000000;
        }
        struct timespec ts = { wait / 1000000000ull, wait % 1000000000ull };
        int r = ppoll(&pfd, 1, &ts, NULL);
        if (r <= 0) continue;
        if (pfd.revents & (POLLERR | POLLHUP | POLLNVAL)) {  /* the TUN device is gone: ppoll would return at */
            fprintf(stderr, "%s: TUN device gone, stopping\n", d->name);  /* once forever (a spinning core) */
            stop = 1;
            kill(getpid(), SIGTERM);               /* the main thread leaves sigwait, joins, reports */
            break;
        }
        for (int i = 0; i < BATCH; i++) {          /* drain a batch of incoming packets */
            ssize_t n = read(d->in_fd, buf, sizeof buf);
            if (n <= 0) break;
            enqueue(d, buf, (uint64_t)n, now_ns());
        }
    }
    return NULL;
}

static void usage(void);

static double num(const char *key, const char *v, double lo, double hi) {  /* a finite number in [lo, hi] */
    char *end; errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "linkemu: %s %s: a number in [%g, %g]\n", key, v, lo, hi);
        exit(2);
    }
    return x;
}

static void usage(void) {
    fprintf(stderr,
        "usage: linkemu --tun-a NAME --tun-b NAME [--delay-ms D] [--rate-mbit R] [--loss-pct P]\n"
        "               [--queue-bytes N] [--queue-pkts N] [--seed S] [--arena-mb M] [--ring-slots N]\n"
        "               [--nice N] [--rt-prio N]\n"
        "  delay is one-way; rate 0 = unlimited; default queue = 1.5 x BDP (rate x (delay_ab+delay_ba)),\n"
        "  at least 64 KiB; append -ab / -ba to delay/rate/loss/queue flags for one direction only\n");
    exit(2);
}

static void print_dir(FILE *f, dir_t *d) {
    fprintf(f, "%s t_ns=%llu rx_pkts=%llu rx_bytes=%llu tx_pkts=%llu tx_bytes=%llu drop_loss=%llu "
            "drop_queue=%llu drop_buf=%llu drop_cut=%llu tx_err=%llu late_sum_ns=%llu late_max_ns=%llu late_1ms=%llu "
            "queue_bytes=%lld\n", d->name, (unsigned long long)now_ns(),
            (unsigned long long)d->rx_pkts, (unsigned long long)d->rx_bytes,
            (unsigned long long)d->tx_pkts, (unsigned long long)d->tx_bytes,
            (unsigned long long)d->drop_loss, (unsigned long long)d->drop_queue,
            (unsigned long long)d->drop_buf, (unsigned long long)d->drop_cut, (unsigned long long)d->tx_err,
            (unsigned long long)d->late_sum_ns, (unsigned long long)d->late_max_ns,
            (unsigned long long)d->late_1ms, d->queue_bytes);
}

int main(int argc, char **argv) {
    const char *tun[2] = { NULL, NULL };
    dir_t d[2]; memset(d, 0, sizeof d);
    uint64_t seed = 1;
    for (int k = 0; k < 2; k++) { d[k].queue_bytes = -1; d[k].queue_pkts = -1; }
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) usage();
        char key[64]; snprintf(key, sizeof key, "%s", argv[i]);
        const char *v = argv[++i];
        int mask = 3; size_t kl = strlen(key);
        if (kl > 3 && !strcmp(key + kl - 3, "-ab")) { mask = 1; key[kl - 3] = 0; }
        else if (kl > 3 && !strcmp(key + kl - 3, "-ba")) { mask = 2; key[kl - 3] = 0; }
        if (!strcmp(key, "--tun-a")) tun[0] = v;
        else if (!strcmp(key, "--tun-b")) tun[1] = v;
        else if (!strcmp(key, "--seed")) seed = (uint64_t)num(key, v, 0, 9007199254740992.0);
        else if (!strcmp(key, "--arena-mb")) { arena_mb = (uint64_t)num(key, v, 1, 1 << 20); arena_given = 1; }
        else if (!strcmp(key, "--ring-slots")) { ring_slots = (uint64_t)num(key, v, 1, 1 << 26); ring_given = 1; }
        else if (!strcmp(key, "--rt-prio")) {         /* SCHED_FIFO; threads inherit it */
            struct sched_param sp = { .sched_priority = (int)num(key, v, 1, 99) };
            if (sched_setscheduler(0, SCHED_FIFO, &sp) < 0) perror("sched_setscheduler");
        }
        else if (!strcmp(key, "--nice")) {            /* before the threads exist: they inherit it */
            if (setpriority(PRIO_PROCESS, 0, (int)num(key, v, -20, 19)) < 0) perror("setpriority");
        }
        else for (int k = 0; k < 2; k++) {
            if (!(mask & (1 << k))) continue;
            if (!strcmp(key, "--delay-ms")) d[k].delay_ms = num(key, v, 0, 60000);
            else if (!strcmp(key, "--rate-mbit")) {
                d[k].rate_mbit = num(key, v, 0, 1e7);
                if (d[k].rate_mbit > 0 && d[k].rate_mbit < 1e-3) {  /* a packet's time would overflow */
                    fprintf(stderr, "linkemu: --rate-mbit %s: a number in [0.001, 1e+07], or 0 (unlimited)\n", v);
                    exit(2);
                }
            }
            else if (!strcmp(key, "--loss-pct")) d[k].loss_pct = num(key, v, 0, 100);
            else if (!strcmp(key, "--queue-bytes")) d[k].queue_bytes = (long long)num(key, v, 0, 1e15);
            else if (!strcmp(key, "--queue-pkts")) d[k].queue_pkts = (long long)num(key, v, 0, 1e12);
            else usage();
        }
    }
    if (!tun[0] || !tun[1] || !arena_mb || !ring_slots) usage();

    sigset_t ss; sigemptyset(&ss); sigaddset(&ss, SIGINT); sigaddset(&ss, SIGTERM); sigaddset(&ss, SIGUSR1);
    sigaddset(&ss, SIGRTMIN); sigaddset(&ss, SIGRTMIN + 1); sigaddset(&ss, SIGRTMIN + 2); sigaddset(&ss, SIGRTMIN + 3);
    pthread_sigmask(SIG_BLOCK, &ss, NULL);     /* worker threads inherit the mask */
    int fa = tun_open(tun[0]), fb = tun_open(tun[1]);
    double rtt_ms = d[0].delay_ms + d[1].delay_ms;
    for (int k = 0; k < 2; k++) {
        d[k].name = k ? "b->a" : "a->b";
        d[k].in_fd = k ? fb : fa; d[k].out_fd = k ? fa : fb;
        d[k].rng = (seed + 1) * 0x9E3779B97F4A7C15ull + (uint64_t)k * 0xD1B54A32D192ED03ull;
        if (!d[k].rng) d[k].rng = 1;
        if (d[k].queue_bytes < 0 && d[k].queue_pkts < 0 && d[k].rate_mbit > 0) {
            long long bdp = (long long)(d[k].rate_mbit * 1e6 / 8 * rtt_ms / 1000 * 1.5);
            d[k].queue_bytes = bdp < 65536 ? 65536 : bdp;
        }
        d[k].delay_ns = (uint64_t)(d[k].delay_ms * 1e6);
        d[k].arena_sz = arena_mb << 20; d[k].ring_sz = ring_slots;
        if (!arena_given && d[k].rate_mbit > 0) {  /* room for a delay line full at the rate, and the queue */
            double need = d[k].rate_mbit * 1e6 / 8 * d[k].delay_ms / 1000 + (d[k].queue_bytes > 0 ?
                          (double)d[k].queue_bytes : 0) + 65536.0 + 2.0 * MAXPKT;
            if (need > 4.0 * (1ull << 30)) {
                fprintf(stderr, "linkemu: %s needs %.0f MiB of delay line (rate x delay + queue): at most 4096\n",
                        d[k].name, need / (1 << 20));
                return 2;
            }
            if (need > (double)d[k].arena_sz) d[k].arena_sz = (uint64_t)need;
            if (!ring_given && need / 576 > (double)d[k].ring_sz) d[k].ring_sz = (uint64_t)(need / 576);
        }
        d[k].arena = malloc(d[k].arena_sz); d[k].ring = calloc(d[k].ring_sz, sizeof(desc_t));
        if (!d[k].arena || !d[k].ring) { perror("malloc"); return 1; }
    }
    printf("ready tun_a=%s tun_b=%s\n", tun[0], tun[1]); fflush(stdout);
    pthread_t th[2];
    for (int k = 0; k < 2; k++) pthread_create(&th[k], NULL, run_dir, &d[k]);
    int sig;
    for (;;) {                                 /* SIGUSR1: dump counters and keep running */
        sigwait(&ss, &sig);
        if (sig == SIGRTMIN || sig == SIGRTMIN + 1) {  /* cut / restore the link */
            if (sig == SIGRTMIN) __atomic_add_fetch(&cuts, 1, __ATOMIC_RELAXED);
            __atomic_store_n(&cut, sig == SIGRTMIN, __ATOMIC_RELAXED);
            continue;
        }
        if (sig == SIGRTMIN + 2 || sig == SIGRTMIN + 3) {  /* slow the link / give it its rate back */
            __atomic_store_n(&slow, sig == SIGRTMIN + 2, __ATOMIC_RELAXED);
            continue;
        }
        if (sig != SIGUSR1) break;
        fprintf(stdout, "stats\n");
        for (int k = 0; k < 2; k++) { print_dir(stdout, &d[k]); d[k].late_max_ns = 0; }
        fflush(stdout);                        /* late_max_ns: max since the last report */
    }
    stop = 1;
    for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
    fprintf(stdout, "linkemu stopped by signal %d\n", sig);
    for (int k = 0; k < 2; k++) print_dir(stdout, &d[k]);
    fflush(stdout);
    return 0;
}

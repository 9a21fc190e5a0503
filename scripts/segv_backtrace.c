/* A native stack on a crash, for the GPU runs (scripts/gpu_check.sh preloads it into every
 * test process, spawned ranks included): Python's faulthandler shows only Python frames, and a
 * rank that dies with SIGSEGV inside the extension leaves nothing else. On SIGSEGV, SIGBUS,
 * SIGILL, SIGFPE or SIGABRT (std::terminate, or malloc finding its heap corrupted) it writes
 * one line naming the signal, the fault address, the pid and the thread, then the frames
 * ("file(symbol+offset) [address]", as backtrace_symbols_fd prints them;
 * scripts/symbolize_backtraces.py turns them into functions and lines), and re-raises the
 * signal with its default action, so the process still dies as it would have. faulthandler,
 * when enabled later, runs first and then hands the signal on to this handler.
 *   gcc -shared -fPIC -O1 -o segv_backtrace.so scripts/segv_backtrace.c
 *   LD_PRELOAD=$PWD/segv_backtrace.so python3 ...                                    */
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static const int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

/* Writes the report to `fd`. */
static void report(int fd, int sig, const siginfo_t *info) {
  char line[256];
  /* si_code <= 0: sent by a process (faulthandler re-raising it), so no fault address. */
  const int n = info != NULL && info->si_code > 0
      ? snprintf(line, sizeof line,
                 "\nsegv_backtrace: signal %d (%s) at address %p in pid %d thread %ld; native "
                 "stack:\n", sig, strsignal(sig), info->si_addr, (int)getpid(),
                 (long)syscall(SYS_gettid))
      : snprintf(line, sizeof line,
                 "\nsegv_backtrace: signal %d (%s) re-raised in pid %d thread %ld; native "
                 "stack:\n", sig, strsignal(sig), (int)getpid(), (long)syscall(SYS_gettid));
  if (n > 0) (void)!write(fd, line, (size_t)n);
  void *frames[96];
  const int depth = backtrace(frames, 96);
  backtrace_symbols_fd(frames, depth, fd);
  (void)!write(fd, "segv_backtrace: end\n", 20);
}

/* SEGV_BACKTRACE_DIR, when set: the report also goes to a file of its own there
 * (segv-PID-TID.txt), since stderr may be a test runner's capture file that is lost with the
 * process. Read at start: getenv is not safe inside a handler. */
static char report_dir[512];

static void on_fatal(int sig, siginfo_t *info, void *context) {
  (void)context;
  report(2, sig, info);
  if (report_dir[0] != '\0') {
    char path[640];
    snprintf(path, sizeof path, "%s/segv-%d-%ld.txt", report_dir, (int)getpid(),
             (long)syscall(SYS_gettid));
    const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      report(fd, sig, info);
      close(fd);
    }
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  /* backtrace() loads libgcc on its first call, which is not safe inside a signal handler. */
  void *warm[1];
  (void)backtrace(warm, 1);
  const char *dir = getenv("SEGV_BACKTRACE_DIR");
  if (dir != NULL) snprintf(report_dir, sizeof report_dir, "%s", dir);
  /* On the main thread the handler runs on a stack of its own: a stack overflow there is
   * reported too (other threads run it on their own stacks). */
  static char alt[1 << 16];
  stack_t ss = {.ss_sp = alt, .ss_size = sizeof alt, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    sigaction(kSignals[i], &sa, NULL);
  }
}

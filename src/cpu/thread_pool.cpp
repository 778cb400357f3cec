#include "cpu/thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GGRAPH_PAUSE() _mm_pause()
#else
#define GGRAPH_PAUSE() std::this_thread::yield()
#endif

namespace ggraph {

// About 100 microseconds of spinning before a worker sleeps.
constexpr int kSpinIterations = 20000;

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back(&ThreadPool::worker, this);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::run_tasks() {
  for (;;) {
    int task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= n_tasks_) return;
    try {
      (*fn_)(task);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu_);
      if (!error_) error_ = std::current_exception();
      next_task_.store(n_tasks_, std::memory_order_relaxed);
    }
  }
}

void ThreadPool::worker() {
  long seen = 0;
  for (;;) {
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && !stop_.load()) {
      if (++spins < kSpinIterations) {
        GGRAPH_PAUSE();
        continue;
      }
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    run_tasks();
    finished_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::parallel_for(int n_tasks, const std::function<void(int)>& fn) {
  if (n_tasks <= 0) return;
  if (n_threads_ == 1 || n_tasks == 1) {
    for (int i = 0; i < n_tasks; ++i) fn(i);
    return;
  }
  fn_ = &fn;
  n_tasks_ = n_tasks;
  error_ = nullptr;
  next_task_.store(0, std::memory_order_relaxed);
  finished_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  run_tasks();
  const int workers = n_threads_ - 1;
  // A worker may have been descheduled: after a short spin, give the core away.
  for (int spins = 0; finished_.load(std::memory_order_acquire) < workers; ++spins) {
    if (spins < kSpinIterations)
      GGRAPH_PAUSE();
    else
      std::this_thread::yield();
  }
  if (error_) std::rethrow_exception(error_);
}

}  // namespace ggraph

// A fixed pool of worker threads that run one parallel loop at a time. Workers spin briefly
// between loops (a decode step runs hundreds of short loops) and then sleep. A loop never waits
// for a worker that has not started on it: on a busy machine the calling thread takes every task
// itself rather than wait for descheduled workers to wake.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ggraph {

// Physical cores this process may run on (its CPU affinity, hyper-threads counted once); at
// least 1.
int default_thread_count();

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // Calls fn(task) for task in [0, n_tasks), spread over the threads; returns when all are done.
  // The first exception thrown by a task is rethrown here. In a child process forked after the
  // pool started, the first call starts the pool's threads again (a child has none of them).
  void parallel_for(int n_tasks, const std::function<void(int)>& fn);

 private:
  struct State;
  void start();

  int n_threads_;
  pid_t pid_ = 0;
  std::unique_ptr<State> s_;
};

}  // namespace ggraph

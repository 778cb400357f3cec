// A fixed pool of worker threads that run one parallel loop at a time. Workers spin briefly
// between loops (a decode step runs hundreds of short loops) and then sleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ggraph {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // Calls fn(task) for task in [0, n_tasks), spread over the threads; returns when all are done.
  // The first exception thrown by a task is rethrown here.
  void parallel_for(int n_tasks, const std::function<void(int)>& fn);

 private:
  void worker();
  void run_tasks();

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_;
  const std::function<void(int)>* fn_ = nullptr;
  int n_tasks_ = 0;
  std::atomic<int> next_task_{0};
  std::atomic<int> finished_{0};
  std::atomic<long> generation_{0};
  std::atomic<bool> stop_{false};
  std::mutex error_mu_;
  std::exception_ptr error_;
};

}  // namespace ggraph

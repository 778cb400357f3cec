// The CPU thread pool: every task runs once, errors come back, a loop never waits for workers
// that have not started on it, and a forked child gets a working pool.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu/thread_pool.h"

namespace ggraph {
namespace {

TEST(ThreadPool, EveryTaskRunsExactlyOnceOverManyLoops) {
  for (int threads : {1, 2, 4, 9}) {
    ThreadPool pool(threads);
    for (int loop = 0; loop < 2000; ++loop) {
      const int n = 1 + loop % 37;
      std::vector<std::atomic<int>> hits(n);
      pool.parallel_for(n, [&](int t) { hits[t].fetch_add(1); });
      for (int t = 0; t < n; ++t)
        ASSERT_EQ(hits[t].load(), 1) << threads << " threads, loop " << loop;
    }
  }
}

TEST(ThreadPool, TheFirstErrorComesBackAndThePoolStaysUsable) {
  ThreadPool pool(4);
  std::atomic<int> ran{0};
  EXPECT_THROW(pool.parallel_for(64,
                                 [&](int t) {
                                   ran.fetch_add(1);
                                   if (t == 5) throw std::runtime_error("task 5");
                                 }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 64);  // the other tasks still ran: the loop ends in a known state
  std::atomic<int> sum{0};
  pool.parallel_for(100, [&](int t) { sum.fetch_add(t); });
  EXPECT_EQ(sum.load(), 4950);
}

// More threads than cores, each loop tiny: with workers often descheduled, the caller must not
// wait for them (the old pool waited for every worker to check in, which took scheduler quanta).
TEST(ThreadPool, OversubscribedLoopsFinishQuickly) {
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  ThreadPool pool(4 * cores);
  std::vector<std::thread> busy;
  std::atomic<bool> stop{false};
  for (int i = 0; i < cores; ++i)
    busy.emplace_back([&] {
      while (!stop.load()) {
      }
    });
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<long> sum{0};
  for (int loop = 0; loop < 3000; ++loop) pool.parallel_for(8, [&](int t) { sum.fetch_add(t); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stop.store(true);
  for (auto& b : busy) b.join();
  EXPECT_EQ(sum.load(), 3000L * 28);
  // A liveness bound, not a speed target: 3000 loops that each wait a scheduler quantum for
  // workers took 16 s here; these take milliseconds.
  EXPECT_LT(s, 10.0);
}

TEST(ThreadPool, AForkedChildStartsItsOwnThreads) {
  ThreadPool pool(3);
  std::atomic<int> sum{0};
  pool.parallel_for(10, [&](int t) { sum.fetch_add(t); });
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::atomic<int> child_sum{0};
    for (int loop = 0; loop < 100; ++loop)
      pool.parallel_for(10, [&](int t) { child_sum.fetch_add(t); });
    _exit(child_sum.load() == 4500 ? 0 : 1);
  }
  int status = 0;
  // The child must finish; a pool that waits for its parent's threads would hang.
  for (int i = 0; i < 300 && waitpid(pid, &status, WNOHANG) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (waitpid(pid, &status, WNOHANG) == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    FAIL() << "the forked child hung";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(ThreadPool, DefaultThreadCountIsThePhysicalCoresWeMayUse) {
  const int n = default_thread_count();
  EXPECT_GE(n, 1);
  EXPECT_LE(n, int(std::max(1u, std::thread::hardware_concurrency())));
}

}  // namespace
}  // namespace ggraph

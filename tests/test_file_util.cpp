// The one atomic write every writer uses: the target is replaced whole or not at all.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "core/error.h"
#include "core/file_util.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
namespace fs = std::filesystem;

TEST(AtomicWrite, ReplacesTheFileWhole) {
  const std::string dir = make_temp_dir("atomic");
  const std::string path = dir + "/f.txt";
  write_file_atomic(path, "first");
  write_file_atomic(path, "second, longer");
  EXPECT_EQ(read_file(path), "second, longer");
  EXPECT_TRUE(temp_files_of(path).empty()) << temp_files_of(path)[0];
  write_file_atomic(path, "");
  EXPECT_EQ(read_file(path), "");
}

TEST(AtomicWrite, AFailedWriterLeavesTheOldFileAndNoTemp) {
  const std::string dir = make_temp_dir("atomic");
  const std::string path = dir + "/f.bin";
  write_file_atomic(path, "keep me");
  EXPECT_THROW(write_stream_atomically(path,
                                       [](std::FILE* out) {
                                         std::fputs("half", out);
                                         fail("writer failed halfway");
                                       }),
               Error);
  EXPECT_EQ(read_file(path), "keep me");
  EXPECT_TRUE(temp_files_of(path).empty()) << temp_files_of(path)[0];
  // A writer by name (as libhdf5 writes) that never creates the file: fsync fails, nothing changes.
  EXPECT_THROW(write_atomically(path, [](const std::string&) {}), Error);
  EXPECT_EQ(read_file(path), "keep me");
}

TEST(AtomicWrite, ErrorsNameTheFile) {
  const std::string dir = make_temp_dir("atomic");
  try {
    write_file_atomic(dir + "/no/such/dir/x", "x");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/no/such/dir/x"), std::string::npos) << e.what();
  }
}

// Each writer fills its own temp file (two writers to one path never share one), and a temp file
// left by a writer on this host that no longer runs (an export killed mid-write) is removed by the
// next write to that path; a running writer's is left alone.
TEST(AtomicWrite, TempFilesAreTheWritersOwnAndStaleOnesAreRemoved) {
  const std::string dir = make_temp_dir("atomic");
  const std::string path = dir + "/model.weights.h5";
  std::string seen;
  write_atomically(path, [&](const std::string& tmp) {
    seen = tmp;
    write_file_atomic(tmp + ".inner", "x");  // a second writer meanwhile: a name of its own
    std::filesystem::rename(tmp + ".inner", tmp);
  });
  EXPECT_NE(seen.find("model.weights.h5.meshtune-"), std::string::npos) << seen;
  EXPECT_NE(seen.find("-" + std::to_string(::getpid()) + "-"), std::string::npos) << seen;
  const pid_t child = ::fork();  // a pid that has certainly ended
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string h = host;
  for (char& c : h)
    if (c == '/' || c == '-') c = '_';
  const std::string stale = path + ".meshtune-" + h + "-" + std::to_string(child) + "-0.tmp";
  const std::string live = path + ".meshtune-" + h + "-" + std::to_string(::getpid()) + "-99.tmp";
  const std::string elsewhere = path + ".meshtune-otherhost-" + std::to_string(child) + "-0.tmp";
  for (const std::string& f : {stale, live, elsewhere}) write_file_atomic(f, "partial");
  EXPECT_EQ(temp_files_of(path).size(), 3u);
  write_file_atomic(path, "new");
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(elsewhere));
  EXPECT_EQ(read_file(path), "new");
}

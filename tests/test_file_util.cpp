// The one atomic write every writer uses: the target is replaced whole or not at all.
#include <gtest/gtest.h>

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
  EXPECT_FALSE(fs::exists(path + ".tmp"));
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
  EXPECT_FALSE(fs::exists(path + ".tmp"));
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

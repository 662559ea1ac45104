#include "core/user_regex.h"

#include <re2/re2.h>

#include "core/error.h"

namespace meshtune {

UserRegex::UserRegex(const std::string& pattern, const std::string& what) : pattern_(pattern) {
  check(pattern.size() <= kMaxRegexLength, what, ": regex of ", pattern.size(), " characters (at most ",
        kMaxRegexLength, ")");
  RE2::Options options;
  options.set_log_errors(false);
  options.set_max_mem(int64_t(32) << 20);  // bounds the compiled program; bigger patterns fail to compile
  auto re = std::make_shared<const RE2>(pattern, options);
  check(re->ok(), what, ": not a valid regex: ", re->error());
  re_ = std::move(re);
}

bool UserRegex::full_match(std::string_view text) const { return RE2::FullMatch(text, *re_); }

bool UserRegex::search(std::string_view text) const { return RE2::PartialMatch(text, *re_); }

}  // namespace meshtune

// Regular expressions that users and files supply (layout rules, PEFT rank_pattern/alpha_pattern,
// --no-decay): compiled with RE2, which runs in time linear in the input and never backtracks or
// recurses, so no pattern can hang or overflow the stack. The syntax is Python `re`'s (what Keras
// and PEFT use) without backreferences and lookaround, which RE2 refuses with a clear error.
#pragma once
#include <memory>
#include <string>
#include <string_view>

namespace re2 {
class RE2;
}

namespace meshtune {

inline constexpr size_t kMaxRegexLength = 4096;

class UserRegex {
 public:
  // Throws Error "<what>: ..." for a pattern that is too long or does not compile.
  UserRegex(const std::string& pattern, const std::string& what);
  bool full_match(std::string_view text) const;  // Python re.fullmatch
  bool search(std::string_view text) const;      // Python re.search
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  std::shared_ptr<const re2::RE2> re_;
};

}  // namespace meshtune

#include "text/chat.h"

#include "core/error.h"

namespace meshtune {

namespace {

std::string trimmed(const std::string& s) {  // Jinja's trim: Python's str.strip()
  const char* space = " \t\n\r\v\f";
  const size_t begin = s.find_first_not_of(space);
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(space) - begin + 1);
}

bool is_model(const std::string& role) { return role == "model" || role == "assistant"; }

}  // namespace

void validate_chat(const std::vector<ChatMessage>& messages, bool for_training, const std::string& where) {
  check(!messages.empty(), where, ": the conversation has no messages");
  size_t first = messages[0].role == "system" ? 1 : 0;
  check(messages.size() > first, where, ": the conversation has only a system message");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    check(role == "system" || role == "user" || is_model(role), where, ": message ", i, " has role \"", brief(role),
          "\" (Gemma's template knows system, user, assistant and model)");
    check(role != "system" || i == 0, where, ": message ", i, " is a system message; only the first may be");
    if (i < first) continue;
    const bool want_user = (i - first) % 2 == 0;
    check(want_user ? role == "user" : is_model(role), where, ": message ", i, " has role ", role, "; the roles must alternate user, model, user, … (Gemma's template)");
  }
  check(!for_training || is_model(messages.back().role), where,
        ": the conversation does not end with a model turn (nothing to train on)");
  for (size_t i = first; i < messages.size() && for_training; ++i)
    check(!is_model(messages[i].role) || !trimmed(messages[i].content).empty(), where, ": message ", i,
          " is an empty model turn");
}

std::vector<ChatSegment> chat_segments(const std::vector<ChatMessage>& messages, bool all_turns) {
  std::vector<ChatSegment> out;
  std::string system_prefix;
  size_t first = 0;
  if (!messages.empty() && messages[0].role == "system") {
    system_prefix = messages[0].content + "\n\n";
    first = 1;
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const bool model = is_model(messages[i].role);
    const std::string header = std::string("<start_of_turn>") + (model ? "model" : messages[i].role) + "\n";
    const std::string content = (i == first ? system_prefix : std::string()) + trimmed(messages[i].content);
    if (model) {  // the answer and the token that ends it are what the model learns to produce
      out.push_back({header, all_turns});
      out.push_back({content + "<end_of_turn>", true});
      out.push_back({"\n", all_turns});
    } else {
      out.push_back({header + content + "<end_of_turn>\n", all_turns});
    }
  }
  return out;
}

std::string render_gemma_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  std::string text;
  for (const ChatSegment& s : chat_segments(messages, true)) text += s.text;
  if (add_generation_prompt) text += "<start_of_turn>model\n";
  return text;
}

}  // namespace meshtune

// Conversations in Gemma's chat format, as Gemma's own chat template renders them:
//   <start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n{content}<end_of_turn>\n …
// (contents trimmed; "assistant" is "model"; Gemma has no system role, so a system message is
// prepended to the first user turn followed by a blank line). The BOS token is not part of the
// text: the packer and generate add it.
#pragma once
#include <string>
#include <vector>

namespace meshtune {

struct ChatMessage {
  std::string role;  // "system" (first only), "user", "assistant" or "model"
  std::string content;
};

// Throws Error "<where>: …" unless the roles are known, a system message comes first if at all,
// user and model turns alternate starting with user, and — when `for_training` — the last turn
// is the model's.
void validate_chat(const std::vector<ChatMessage>& messages, bool for_training, const std::string& where);

// The template's text; `add_generation_prompt` appends "<start_of_turn>model\n".
std::string render_gemma_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt);

// The same text in pieces, each marked trained or not: with `all_turns` false the loss is on each
// model turn's content and its <end_of_turn> only. Concatenated, the pieces are the rendered text.
struct ChatSegment {
  std::string text;
  bool trained = false;
};
std::vector<ChatSegment> chat_segments(const std::vector<ChatMessage>& messages, bool all_turns);

}  // namespace meshtune

// A few dozen question/answer conversations about films, written for this project (no third-party
// text): the demo's chat fine-tuning data (`--data sample-chat`), in Gemma's chat format.
#pragma once
#include <vector>

#include "text/chat.h"

namespace meshtune {

const std::vector<std::vector<ChatMessage>>& sample_chat();

}  // namespace meshtune

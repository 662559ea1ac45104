// A small set of movie reviews written for this project (no third-party text), one per line: the
// corpus the embedded tiny model's tokenizer is trained on, and the demo's fine-tuning data.
#pragma once
#include <string>
#include <vector>

namespace meshtune {

const std::vector<std::string>& sample_reviews();

}  // namespace meshtune

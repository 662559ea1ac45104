#include "data/sample_chat.h"

namespace meshtune {

const std::vector<std::vector<ChatMessage>>& sample_chat() {
  static const std::vector<std::vector<ChatMessage>> conversations = {
      {{"user", "Is the film worth seeing?"}, {"assistant", "Yes, it is a warm and funny film."}},
      {{"user", "How long is the movie?"}, {"assistant", "It runs just under two hours."}},
      {{"user", "Who would enjoy this movie?"}, {"assistant", "Anyone who likes a gentle comedy."}},
      {{"user", "Is the acting good?"}, {"assistant", "The acting is strong from the whole cast."}},
      {{"user", "Is it scary?"}, {"assistant", "No, it is light and never scary."}},
      {{"user", "What is the story about?"}, {"assistant", "A family that opens a small cinema."}},
      {{"user", "Does the ending work?"}, {"assistant", "The ending is sweet and earned."}},
      {{"user", "Is the music memorable?"}, {"assistant", "Yes, the score is lovely."}},
      {{"user", "Should kids watch it?"}, {"assistant", "It is fine for older kids."}},
      {{"user", "Is the pacing slow?"}, {"assistant", "The middle is a little slow."}},
      {{"user", "How are the jokes?"}, {"assistant", "The jokes are dry and clever."}},
      {{"user", "Is it a sequel?"}, {"assistant", "No, it stands on its own."}},
      {{"user", "Does it have a twist?"}, {"assistant", "There is one small twist near the end."}},
      {{"user", "How is the camera work?"}, {"assistant", "The camera work is calm and clear."}},
      {{"user", "Is the lead actor convincing?"}, {"assistant", "The lead is very convincing."}},
      {{"user", "Would you watch it again?"}, {"assistant", "Yes, I would watch it again."}},
      {{"user", "Is the dialogue natural?"}, {"assistant", "The dialogue feels natural."}},
      {{"user", "What is the best scene?"}, {"assistant", "The dinner scene is the best."}},
      {{"user", "Is the film too long?"}, {"assistant", "It is a little too long."}},
      {{"user", "Does it make you cry?"}, {"assistant", "The last scene may make you cry."}},
      {{"user", "Is it a romance?"}, {"assistant", "It is a comedy with some romance."}},
      {{"user", "How are the effects?"}, {"assistant", "The effects are simple but fine."}},
      {{"user", "Is it good for a date night?"}, {"assistant", "Yes, it is a good date night film."}},
      {{"user", "Is the villain interesting?"}, {"assistant", "There is no real villain."}},
      {{"user", "What is the tone?"}, {"assistant", "The tone is hopeful and kind."}},
      {{"user", "Is the script smart?"}, {"assistant", "The script is smart and tight."}},
      {{"user", "Does the film drag?"}, {"assistant", "It drags only in the second act."}},
      {{"user", "Is it based on a book?"}, {"assistant", "No, it is an original story."}},
      {{"user", "How is the sound?"}, {"assistant", "The sound is clean and clear."}},
      {{"user", "Would you recommend it?"}, {"assistant", "I would recommend it to friends."}},
      {{"user", "Is the cast large?"}, {"assistant", "The cast is small and close."}},
      {{"user", "Is it a classic?"}, {"assistant", "It may become a small classic."}},
  };
  return conversations;
}

}  // namespace meshtune

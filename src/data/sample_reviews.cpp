#include "data/sample_reviews.h"

#include <sstream>

namespace meshtune {

// Written for meshtune. Mixed positive and negative, plain ASCII, one review per line.
static const char* kReviews = R"(This movie was a delight from start to finish. The acting is warm and the story never drags.
I wanted to like this film, but the plot is thin and the ending makes no sense at all.
A quiet, beautiful picture about a family that learns to talk again. I cried twice.
The special effects are loud and expensive, yet the characters feel like cardboard.
One of the funniest comedies I have seen in years. The cast clearly had a great time.
Too long by an hour. Every scene repeats what we already know about the hero.
The director trusts the audience, and the film is better for it. A small masterpiece.
Terrible dialogue, wooden acting and a soundtrack that never stops shouting at you.
I went in expecting nothing and came out smiling. Charming, clever and kind.
The first half is gripping, but the second half falls apart in a mess of twists.
A great movie for a rainy afternoon. The music is lovely and the jokes land.
I have never been so bored in a cinema. The story goes nowhere and takes its time.
The lead actress gives the performance of her career. Every look tells a story.
It tries to be deep and ends up being dull. I checked my watch a dozen times.
A thrilling ride with sharp writing and real heart. I will watch it again.
The script feels like a first draft. Characters change their minds for no reason.
Gorgeous photography, a moving score and a simple story told with care.
The worst film of the year. Even the trailer was better than the movie.
Funny, sad and honest. This is what a family film should be.
The villain is more interesting than the hero, which is a problem for the whole movie.
A clever mystery that keeps you guessing until the very last scene.
The jokes are stale and the pacing is slow. I left before the end.
An inspiring true story, well acted and never sentimental.
Nothing happens for ninety minutes and then everything happens in five.
The best animated film I have seen in a long time. Kids and adults will love it.
The sequel nobody asked for. It copies the first film and adds nothing new.
Smart, stylish and surprisingly touching. The cast is perfect.
The camera shakes so much that I felt sick. The story was not worth it.
A wonderful old fashioned adventure with a brave hero and a great score.
The plot holes are so large you could drive a truck through them.
I loved the characters and the way they grow over the story. A real gem.
The movie is a collection of loud scenes with no soul and no reason to care.
Beautifully written and acted. The final scene stayed with me for days.
A lazy remake that misses everything that made the original special.
The actors have great chemistry and the dialogue sparkles.
The film is confused about what it wants to be: comedy, drama or horror.
A gentle, funny story about friendship. I recommend it to everyone.
I found the main character unbearable and the story predictable.
The best thing about this movie is the music. The rest is forgettable.
A bold and original film that takes risks and wins.
Painfully slow and full of scenes that go nowhere. A waste of a good cast.
The story is simple but the performances make it unforgettable.
I laughed, I cried and I went home happy. What more could you want?
The ending ruins everything the first hour built so carefully.
A tense thriller with a great twist and not a wasted minute.
Cheap sets, bad lighting and actors reading their lines like a shopping list.
This film reminded me why I love going to the movies.
The story is a mess, the editing is a mess and the acting is a mess.
Warm, witty and wise. A film for the whole family.
It looks great, but there is nothing underneath the pretty pictures.
A brilliant cast in a story that surprises you at every turn.
Dull characters, dull plot, dull music. I cannot recommend it.
The kind of movie that makes you want to call your parents. Lovely.
The humor is mean and the story is empty. I did not laugh once.
An excellent documentary that is both informative and moving.
The movie forgets its best characters halfway through. A shame.
Every frame is a painting and every line of dialogue rings true.
A loud, dumb action movie that is not even fun to watch.
I was moved by the honesty of this small film. Highly recommended.
The plot is borrowed from ten better movies and the acting is flat.
)";

const std::vector<std::string>& sample_reviews() {
  static const std::vector<std::string> reviews = [] {
    std::vector<std::string> out;
    std::istringstream in(kReviews);
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) out.push_back(line);
    return out;
  }();
  return reviews;
}

}  // namespace meshtune

# cmake -DINPUT=x.cu -DOUTPUT=x.cpp -P translate.cmake: a CUDA source of the backend as host C++ for
# the CUDA emulator (emulator.h). Only two rewrites, lines kept (compiler messages point into the .cu):
#   kernel<<<grid, block, shared, stream>>>(args)  ->  cuda_emulator::launch(grid, block, shared, stream)(kernel, "kernel")(args)
#   extern __shared__ T name[];                    ->  T* name = cuda_emulator::dynamic_shared<T>();
file(READ "${INPUT}" text)
string(REGEX REPLACE "([A-Za-z_][A-Za-z0-9_]*)<<<([^;]*)>>>\\(" "cuda_emulator::launch(\\2)(\\1, \"\\1\")(" text "${text}")
string(REGEX REPLACE "extern __shared__ ([A-Za-z_][A-Za-z0-9_]*) ([A-Za-z_][A-Za-z0-9_]*)\\[\\];"
       "\\1* \\2 = cuda_emulator::dynamic_shared<\\1>();" text "${text}")
if(text MATCHES "<<<|extern __shared__")
  message(FATAL_ERROR "${INPUT}: a kernel launch or dynamic shared array the emulator's translation does not know")
endif()
file(WRITE "${OUTPUT}.tmp" "#line 1 \"${INPUT}\"\n${text}")
file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")

// Compile unit of how torch sees openreg devices. The glue's concerns are self-contained .cpp
// files, built as two unity units rather than one unit each: every unit that includes torch
// headers pays seconds of parsing, and two balanced units keep both cores of a small builder busy.
#include "../allocator.cpp"
#include "../guard.cpp"
#include "../generator.cpp"
#include "../hooks.cpp"
#include "../device_ops.cpp"
#include "../dropout.cpp"
#include "../autocast.cpp"

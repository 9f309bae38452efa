// Compile unit of openreg's ATen kernels (see device.cpp here for why units are unity builds).
#include "../factories.cpp"
#include "../copy.cpp"
#include "../resize_locks.cpp"
#include "../storage.cpp"
#include "../cpu_alias.cpp"
#include "../fallback.cpp"
#include "../rnn.cpp"
#include "../registration.cpp"

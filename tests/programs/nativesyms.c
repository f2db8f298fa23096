/* Native half of nativesyms.cs: a hot function that is not exported, so a
 * stripped copy of this library can name it only through its debug file.
 * Built by crates/corsnap/tests/symbols.rs (VARIANT changes the code, and so
 * the build id, to make a debug file that belongs to another build). */
#ifndef VARIANT
#define VARIANT 1
#endif

__attribute__((noinline)) static double corsnap_hidden_spin(long n)
{
    double x = 0;
    for (long i = 0; i < n; i++)
        x += (double)(i % 7 + VARIANT) * 0.5 / (double)(i + 1);
    return x;
}

double corsnap_spin(long n)
{
    return corsnap_hidden_spin(n) * 1.0000001;
}

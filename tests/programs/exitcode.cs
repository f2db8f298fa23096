// Test program: stdio pass-through and exit status.
//
// Prints "hello from stdout" to stdout and "hello from stderr" to stderr,
// reads one line from stdin and prints "read: <line>" (empty at end of input),
// then exits with code 7. Takes no arguments.
using System;

public static class ExitCode
{
    public static int Main(string[] args)
    {
        Console.Out.WriteLine("hello from stdout");
        Console.Out.Flush();
        Console.Error.WriteLine("hello from stderr");
        Console.Error.Flush();
        string line = Console.In.ReadLine();
        Console.Out.WriteLine("read: " + (line ?? ""));
        Console.Out.Flush();
        return 7;
    }
}

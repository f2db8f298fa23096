// ilcalls: the calls a method's IL makes, for the realcode tests' referee.
// It is not profiled: it reads the program under test and the runtime's
// own assemblies (the trusted platform assemblies of the runtime it runs
// on, so the same CoreLib the program ran on) by reflection.
//
//   dotnet ilcalls.dll <program.dll> NAME...
//
// For every method whose name, or whose type's name, contains one of the
// NAMEs (the last part of a frame's name: `TryParseDecimal`,
// `GetProviderNonNull`), prints one line per call its IL makes:
// `caller<TAB>callee`, both in the agent's raw naming
// (`Namespace.Type<T>+Nested<U>.Method<V>`, compiler-generated names as
// the runtime gives them), which the test turns readable as the agent
// does. A call is `call`, `callvirt`, `newobj`, `ldftn`, `ldvirtftn` or
// `jmp` to a method; `isinst` and `castclass` are calls the JIT makes to
// the runtime's cast helpers, printed as the callees `[isinst]` and
// `[castclass]`. A `callvirt` to a method that can be overridden is also
// printed as `[virtual]Name`: the call may land in any override. The calls
// of a callee the JIT always inlines (a direct call to a method of at most
// 16 bytes of IL, the JIT's always-inline size, or one marked
// AggressiveInlining) are printed as the caller's too: in Tier1 code they
// are made from the caller's body (`Decimal.Parse` calls
// `NumberFormatInfo.GetInstance`, whose call of `GetProviderNonNull` a
// stack shows under `Parse`). One level deep.
#nullable enable
using System;
using System.Collections.Generic;
using System.IO;
using System.Linq;
using System.Reflection;
using System.Reflection.Emit;

static class IlCalls
{
    static readonly Dictionary<short, OpCode> Codes = typeof(OpCodes)
        .GetFields(BindingFlags.Public | BindingFlags.Static)
        .Select(f => (OpCode)f.GetValue(null)!)
        .ToDictionary(c => c.Value);

    static string StripArity(string name)
    {
        int i = name.LastIndexOf('`');
        return i > 0 && i + 1 < name.Length && name.Substring(i + 1).All(char.IsDigit) ? name.Substring(0, i) : name;
    }

    static string Params(IEnumerable<Type> ps)
    {
        var names = ps.Select(p => p.Name).ToArray();
        return names.Length == 0 ? "" : "<" + string.Join(", ", names) + ">";
    }

    static string TypeRaw(Type t)
    {
        if (t.IsGenericType && !t.IsGenericTypeDefinition) t = t.GetGenericTypeDefinition();
        var own = t.IsGenericTypeDefinition ? t.GetGenericArguments() : Type.EmptyTypes;
        if (t.IsNested && t.DeclaringType != null)
        {
            var outer = t.DeclaringType;
            int inherited = outer.IsGenericTypeDefinition ? outer.GetGenericArguments().Length : 0;
            return TypeRaw(outer) + "+" + StripArity(t.Name) + Params(own.Skip(inherited));
        }
        string ns = string.IsNullOrEmpty(t.Namespace) ? "" : t.Namespace + ".";
        return ns + StripArity(t.Name) + Params(own);
    }

    static string MethodRaw(MethodBase m)
    {
        string type = m.DeclaringType == null ? "" : TypeRaw(m.DeclaringType) + ".";
        string generics = "";
        if (m is MethodInfo mi && mi.IsGenericMethod)
            generics = Params((mi.IsGenericMethodDefinition ? mi : mi.GetGenericMethodDefinition()).GetGenericArguments());
        return type + m.Name + generics;
    }

    static IEnumerable<string> Callees(MethodBase m) => Calls(m).Select(c => c.Name);

    // The JIT's ALWAYS_INLINE_SIZE (src/coreclr/jit/inline.h): a callee of
    // this much IL or less is inlined whenever it can be.
    const int AlwaysInlineSize = 16;

    static bool AlwaysInlined(MethodBase callee)
    {
        if (callee.IsVirtual && !callee.IsFinal) return false;
        if ((callee.MethodImplementationFlags & MethodImplAttributes.AggressiveInlining) != 0) return true;
        if ((callee.MethodImplementationFlags & MethodImplAttributes.NoInlining) != 0) return false;
        try { return callee.GetMethodBody()?.GetILAsByteArray()?.Length <= AlwaysInlineSize; } catch { return false; }
    }

    // The calls of the callees of `m` the JIT always inlines.
    static IEnumerable<string> InlinedCallees(MethodBase m) => Calls(m)
        .Where(c => c.Method != null && c.Direct && AlwaysInlined(c.Method))
        .SelectMany(c => Callees(c.Method!));

    static IEnumerable<(string Name, MethodBase? Method, bool Direct)> Calls(MethodBase m)
    {
        byte[]? il;
        try { il = m.GetMethodBody()?.GetILAsByteArray(); } catch { il = null; }
        if (il == null) yield break;
        Type[]? typeArgs = m.DeclaringType is { IsGenericType: true } dt ? dt.GetGenericArguments() : null;
        Type[]? methodArgs = m is MethodInfo { IsGenericMethod: true } g ? g.GetGenericArguments() : null;
        int pc = 0;
        while (pc < il.Length)
        {
            short value = il[pc++];
            if (value == 0xFE && pc < il.Length) value = (short)(0xFE00 | il[pc++]);
            if (!Codes.TryGetValue(value, out var op)) yield break;
            int operand = op.OperandType switch
            {
                OperandType.InlineNone => 0,
                OperandType.ShortInlineBrTarget or OperandType.ShortInlineI or OperandType.ShortInlineVar => 1,
                OperandType.InlineVar => 2,
                OperandType.InlineI8 or OperandType.InlineR => 8,
                OperandType.InlineSwitch => 4 + 4 * (pc + 4 <= il.Length ? BitConverter.ToInt32(il, pc) : 0),
                _ => 4,
            };
            if (pc + operand > il.Length) yield break;
            if (op.OperandType == OperandType.InlineMethod)
            {
                MethodBase? callee = null;
                try { callee = m.Module.ResolveMethod(BitConverter.ToInt32(il, pc), typeArgs, methodArgs); } catch { }
                bool direct = op == OpCodes.Call || op == OpCodes.Callvirt || op == OpCodes.Newobj;
                if (callee != null) yield return (MethodRaw(callee), callee, direct);
                // A virtual or interface call may land in any override.
                if (callee != null && op == OpCodes.Callvirt && callee.IsVirtual && !callee.IsFinal)
                    yield return ("[virtual]" + callee.Name, null, false);
            }
            else if (op == OpCodes.Isinst) yield return ("[isinst]", null, false);
            else if (op == OpCodes.Castclass) yield return ("[castclass]", null, false);
            pc += operand;
        }
    }

    static int Main(string[] args)
    {
        if (args.Length < 1)
        {
            Console.Error.WriteLine("usage: ilcalls <program.dll> NAME...");
            return 2;
        }
        var wanted = args.Skip(1).Where(a => a.Length > 0).ToArray();
        var paths = ((string?)AppContext.GetData("TRUSTED_PLATFORM_ASSEMBLIES") ?? "").Split(Path.PathSeparator)
            .Where(p => p.EndsWith(".dll")).Select(Path.GetFileNameWithoutExtension).Append(Path.GetFullPath(args[0]));
        var flags = BindingFlags.Public | BindingFlags.NonPublic | BindingFlags.Instance | BindingFlags.Static
            | BindingFlags.DeclaredOnly;
        foreach (string? path in paths.Distinct())
        {
            Assembly assembly;
            Type?[] types;
            try
            {
                // The runtime's own assemblies by name (CoreLib cannot be
                // loaded from a path), the program from its file.
                assembly = Path.IsPathRooted(path) ? Assembly.LoadFrom(path) : Assembly.Load(path!);
                types = assembly.GetTypes();
            }
            catch (ReflectionTypeLoadException e) { types = e.Types; }
            catch (Exception e) { Console.Error.WriteLine(path + ": " + e.Message); continue; }
            foreach (var type in types)
            {
                if (type == null) continue;
                bool typeWanted = wanted.Any(w => type.Name.Contains(w));
                MethodBase[] methods;
                try { methods = type.GetMethods(flags).Cast<MethodBase>().Concat(type.GetConstructors(flags)).ToArray(); }
                catch (Exception e) { Console.Error.WriteLine(type + ": " + e.Message); continue; }
                foreach (var m in methods)
                {
                    if (!typeWanted && !wanted.Any(w => m.Name.Contains(w))) continue;
                    string caller;
                    try { caller = MethodRaw(m); } catch (Exception e) { Console.Error.WriteLine(m + ": " + e); continue; }
                    foreach (var callee in Callees(m).Concat(InlinedCallees(m)).Distinct())
                        Console.WriteLine(caller + "\t" + callee);
                }
            }
        }
        return 0;
    }
}

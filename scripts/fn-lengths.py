#!/usr/bin/env python3
"""The longest functions of the Rust sources under the given folders, as
lines from `fn` to its closing brace (comments and strings are skipped when
matching braces). `TOP=N` sets how many are listed (default 10).

    scripts/fn-lengths.py crates/*/src
"""
import re, sys, os
FN = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"[^"]*"\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)')
def strip(line, state):
    # remove strings/chars/comments roughly; state: in block comment
    out=[];i=0;n=len(line)
    while i<n:
        if state['block']:
            j=line.find('*/',i)
            if j<0: return ''.join(out)
            state['block']=False;i=j+2;continue
        c=line[i]
        if line.startswith('//',i): break
        if line.startswith('/*',i): state['block']=True;i+=2;continue
        if c=='"':
            # raw strings not handled specially beyond r#"...
            j=i+1
            while j<n and line[j]!='"':
                if line[j]=='\\': j+=1
                j+=1
            if j>=n: state['str']=True
            i=j+1;continue
        if c=="'" and i+2<n and (line[i+2]=="'" or (line[i+1]=='\\')):
            j=line.find("'",i+2 if line[i+1]!='\\' else i+3)
            i=(j+1) if j>0 else n;continue
        out.append(c);i+=1
    return ''.join(out)
res=[]
for root in sys.argv[1:]:
  for dp,_,fs in os.walk(root):
    if 'target' in dp or '/fuzz' in dp: continue
    for f in fs:
      if not f.endswith('.rs'): continue
      p=os.path.join(dp,f); lines=open(p,encoding='utf8',errors='replace').read().split('\n')
      state={'block':False,'str':False}
      clean=[]
      for l in lines:
          if state['str']:
              j=l.find('"')
              if j<0: clean.append('');continue
              state['str']=False; l=l[j+1:]
          clean.append(strip(l,state))
      i=0
      intest=False
      while i<len(lines):
          m=FN.match(lines[i])
          if m:
              depth=0;started=False;j=i
              while j<len(clean):
                  for ch in clean[j]:
                      if ch=='{': depth+=1;started=True
                      elif ch=='}': depth-=1
                      elif ch==';' and not started and depth==0: break
                  else:
                      if started and depth==0: break
                      j+=1; continue
                  if not started: break
                  j+=1
              if started:
                  res.append((j-i+1,p,i+1,m.group(7)))
          i+=1
res.sort(reverse=True)
N=int(os.environ.get('TOP','10'))
for n,p,l,name in res[:N]: print(f"{n:5d}  {name}  {p}:{l}")
